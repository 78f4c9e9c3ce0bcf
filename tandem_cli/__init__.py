"""The `tandem` command: one entry point whose subcommands live beside the code they drive."""

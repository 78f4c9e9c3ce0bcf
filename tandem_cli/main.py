"""`tandem` — the console command. Subcommands are small modules in this package."""

from __future__ import annotations

import os

import typer

from control_panel import cli as panel_cli
from node_agent import cli as agent_cli
from tandem_protocol.settings import SettingsError

from . import bench_ttft, demo_cmd, model_cmd, up_cmd

app = typer.Typer(
    help="Tandem: one LLM service from the machines on your desk (prefill/decode disaggregation).",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(model_cmd.app, name="model")
app.add_typer(agent_cli.app, name="agent")
app.command("panel")(panel_cli.panel)
app.command("demo")(demo_cmd.demo)
app.command("up")(up_cmd.up)
bench = typer.Typer(help="Benchmarks.", no_args_is_help=True)
bench.command("ttft")(bench_ttft.bench_ttft)
app.add_typer(bench, name="bench")


def main() -> None:
    # What Tandem writes (keys, the panel's database, identities, logs) is its user's alone
    os.umask(0o077)
    try:
        app()
    except SettingsError as e:  # read at the start of a command: say which variable, no traceback
        raise SystemExit(str(e)) from None


if __name__ == "__main__":
    main()

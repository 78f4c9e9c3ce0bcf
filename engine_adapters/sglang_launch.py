"""`python -m engine_adapters.sglang_launch <sglang.launch_server's arguments>`: SGLang's server,
with the API key its agent made for it (engine_adapters/server_process.py) taken from the
environment. SGLang reads its key from the command line only, which every local user can read
(`ps`); this adds it inside the process, where they cannot."""

from __future__ import annotations

import os
import runpy
import sys

from engine_adapters.server_process import ServerProcess

if __name__ == "__main__":
    key = os.environ.pop(ServerProcess.api_key_env, None)
    if key:
        sys.argv.append(f"--api-key={key}")  # one argument: a key starting with "-" is no option
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)

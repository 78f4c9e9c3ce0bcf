"""`tandem up`: the whole product on one machine — two agents and a panel, already paired.

Starts a torch agent (prefill) and an MLX agent (decode) on the embedded model, and the panel with
the pair `smollm2` (torch -> MLX) and `smollm2-reverse` (MLX -> torch), all bound to 127.0.0.1 and
without LAN announcements. Prints the panel URL, the admin password, an API key and one example
answer through the pair, then runs until Ctrl-C and stops everything cleanly. The API key is made
anew at each start and the one the last start printed is revoked: keys do not pile up.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import typer

from control_panel.cli import issue_credentials
from node_agent.identity import cluster_key
from tandem_protocol.settings import data_dir

from .model_cmd import ensure_embedded_model
from .processes import ServiceProcess, agent_serve_args
from .progress import console

UP_KEY_NAME = "tandem up"  # the API key it prints: one, made anew at each start


def up(
    prefill: str = typer.Option("torch", help="Engine of the prefill agent."),
    decode: str = typer.Option("mlx", help="Engine of the decode agent."),
    panel_port: int = typer.Option(8080, help="Panel port."),
    ask: str = typer.Option("What is the capital of France?", help="Example question asked once at start."),
) -> None:
    """Run two local agents and the panel, paired, on the embedded model."""
    model = ensure_embedded_model()
    key = cluster_key()
    home = data_dir()
    env = {"TANDEM_CLUSTER_KEY": key}
    services: list[ServiceProcess] = []
    stop = threading.Event()
    # Before anything starts, so a stop at any moment stops the services. SIGINT too, explicitly:
    # a shell starts background jobs with SIGINT ignored, and Python then never raises
    # KeyboardInterrupt (the services, on uvicorn, handle it themselves).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with console.status(f"starting the {prefill} and {decode} agents…"):
            agents = [
                ServiceProcess(
                    agent_serve_args(engine, model, "--name", f"{role}-{engine}", tls=True),
                    env={**env, "TANDEM_HOME": str(home / "agents" / role)},
                )
                for role, engine in (("prefill", prefill), ("decode", decode))
            ]
            services += agents
            p_url, d_url = (a.wait_ready() for a in agents)
        panel_dir = home / "panel"
        # one key for `tandem up`, made anew at each start (the last one's revoked, and those of
        # versions that named theirs make-run-XXXX)
        password, api_key = issue_credentials(panel_dir, UP_KEY_NAME, replaces="make-run-")
        with console.status("starting the panel…"):
            panel = ServiceProcess(
                [
                    "panel",
                    "--port",
                    str(panel_port),
                    "--data-dir",
                    str(panel_dir),
                    "--no-mdns",  # everything it serves is on this machine: it listens to no LAN
                    "--pair",
                    f"smollm2={p_url},{d_url}",
                    "--pair",
                    f"smollm2-reverse={d_url},{p_url}",
                ],
                env={**env, "COLUMNS": "300"},
            )
            services.append(panel)
            panel_url = panel.wait_ready()
        console.print(f"\n[bold green]Tandem is up[/]  panel {panel_url}  ·  OpenAI API {panel_url}/v1")
        console.print(
            f"  prefill agent {p_url} ({prefill}) -> decode agent {d_url} ({decode}), model "
            "[bold]smollm2[/] (and [bold]smollm2-reverse[/])"
        )
        console.print(
            "  admin password: "
            + (
                password
                or "unchanged since the first start (`.venv/bin/tandem panel --reset-admin-password` "
                "prints a new one, also while this runs)"
            )
        )
        console.print(f"  API key: {api_key}")
        example(panel_url, api_key, ask)
        console.print(
            f"\n  curl {panel_url}/v1/chat/completions -H 'Authorization: Bearer {api_key}' "
            '-H \'Content-Type: application/json\' -d \'{"model": "smollm2", "stream": true, '
            '"messages": [{"role": "user", "content": "Hello!"}]}\''
        )
        console.print("\nCtrl-C stops everything.")
        while not stop.wait(3600):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        with console.status("stopping…"):
            for service in reversed(services):
                service.stop()
        console.print("stopped.")


def example(panel_url: str, api_key: str, question: str) -> None:
    """One streamed answer through the pair, with its time to first token."""
    body = {
        "model": "smollm2",
        "stream": True,
        "max_tokens": 64,
        "temperature": 0,
        "messages": [{"role": "user", "content": question}],
        "stream_options": {"include_usage": True},
    }
    console.print(f"\n  [bold]user[/] {question}\n  [bold]assistant[/] ", end="")
    t0, ttft = time.perf_counter(), None
    with httpx.stream(
        "POST",
        f"{panel_url}/v1/chat/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {api_key}"},
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text = choice["delta"].get("content")
                if text:
                    ttft = ttft or time.perf_counter() - t0
                    console.print(text, end="", markup=False, highlight=False)
    console.print(f"\n  [dim](first token after {ttft * 1000:.0f} ms through the torch -> MLX pair)[/]")

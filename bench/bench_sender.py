"""Does streaming its pages slow the prefiller's own prefill? P's prefill alone against P's prefill
while the same process streams the pages to a reader, for each page sender and transport.

    .venv/bin/python bench/bench_sender.py [--tokens 4096] [--rounds 5] [--senders loop,thread]
        [--transports plain,tls] [--device cpu|cuda] [--model DIR] [--p-cpus 0] [--reader-cpus 1]

One agent per (transport, sender) — `tandem agent serve --page-sender loop|thread`, plain HTTP or
its own TLS certificate (pinned by the reader) — all started first, then measured in interleaved
rounds so the machine's load drifts alike over every cell. A round, per agent:
- alone: POST /v1/handoffs, wait until its prefill has ended with nothing read (the pages stay
  staged), then read the stream: the final frame's `prefill_seconds` is P's prefill alone;
- P/D: POST /v1/handoffs and read the page stream at once, as a decoder does (this process is the
  reader, through Tandem's own page receiver, every frame checked): `prefill_seconds` is P's prefill
  while its event loop (or its sender thread) writes the pages.
Prints each cell's median prefill alone and in P/D and their ratio (the goal: <= 1.10).

The default model is a random-weight Llama built here (`--model` takes any checkpoint): small
matrices and many wide KV heads, so that the engine thread is host-bound, as a small model is on a
GPU, and each page is large (2 MiB) — the case where the page writes compete with the engine thread
for the GIL. On CUDA (the GPU recipe: `BENCH=sender bash bench/gpu_scale_run.sh`) pass `--device cuda`.
Writes bench/results/sender-<date>.json and .md (the command in both).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_adapters.embedded_model import model_dir  # noqa: E402
from node_agent.identity import known_certificates  # noqa: E402
from tandem_cli.processes import ServiceProcess, agent_serve_args  # noqa: E402
from tandem_protocol.client import AgentClient  # noqa: E402
from tandem_protocol.handoff import PrefillDone  # noqa: E402
from tandem_protocol.settings import data_dir  # noqa: E402

KEY = "tdm_bench-sender-key-0123456789abcdef"


def build_model(path: Path) -> Path:
    """A random-weight Llama: hidden 64, 32 layers of 4 KV heads of 64 → 2 MiB per 64-token page."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.float16).save_pretrained(path)
    tok = model_dir(data_dir())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tok / name).is_file():
            shutil.copy(tok / name, path / name)
    return path


class Agent:
    def __init__(self, args, model: Path, transport: str, sender: str, home: Path):
        self.transport, self.sender = transport, sender
        self.name = f"{transport}-{sender}"
        self.home = home / self.name
        extra = ["--name", self.name, "--prefix-cache-bytes", "0", "--staging-bytes", "16GiB"]
        extra += ["--page-sender", sender, "--handoff-ttl", "600"]
        if args.device:
            extra += ["--device", args.device]
        self.proc = ServiceProcess(
            agent_serve_args("torch", model, *extra, tls=transport == "tls"),
            env={"TANDEM_CLUSTER_KEY": KEY, "TANDEM_HOME": str(self.home)},
            cpus=args.p_cpus,
        )

    def ready(self) -> None:
        self.url = self.proc.wait_ready(600)
        pin = known_certificates(self.home).get(self.name) if self.transport == "tls" else None
        self.client = AgentClient(self.url, KEY, pin=pin)

    async def prefill(self, ids: list[int], read_at_once: bool) -> float:
        """One handoff of `ids`; its prefill seconds (read at once, or after its prefill ended)."""
        info = await self.client.info()
        hid = uuid.uuid4().hex
        created = await self.client.create_handoff(
            handoff_id=hid, token_ids=ids, contract=info["contract"]["fingerprint"], wait_timeout=600
        )
        if not read_at_once:  # a bench's wait: P's own status, every 20 ms, until its prefill has ended
            while True:
                states = {h["handoff_id"]: h["state"] for h in (await self.client.status())["handoffs"]}
                if states.get(hid) != "prefilling":
                    break
                await asyncio.sleep(0.02)
        done = None
        async with self.client.page_stream(hid, None, token=created["read_token"]) as stream:
            async for item in stream:
                if isinstance(item, PrefillDone):
                    done = item
        assert done is not None and done.pages == created["pages"], (done, created)
        return done.prefill_seconds


async def measure(args, agents: list[Agent], ids: list[int]) -> dict:
    cells = {a.name: {"alone": [], "pd": []} for a in agents}
    for a in agents:  # warm-up: the first prefill of a process pays for its allocations
        await a.prefill(ids, True)
        await a.prefill(ids, False)
    for r in range(args.rounds):
        for a in agents if r % 2 == 0 else reversed(agents):
            for kind in ("alone", "pd") if r % 2 == 0 else ("pd", "alone"):
                s = await a.prefill(ids, kind == "pd")
                cells[a.name][kind].append(s)
                print(f"  round {r} {a.name:14s} {kind:5s} {s * 1000:8.1f} ms", flush=True)
    return cells


# --engine synthetic: the GIL path alone, in this process. An "engine thread" that is host-bound
# as a GPU prefill is (tiny torch ops, one after another: each needs the GIL to be queued), making
# PAGES_PER_CHUNK pages of `--page-mib` after each chunk; this process's uvicorn (PageStreamProtocol,
# each sender, plain or TLS) streams them to a reader process over loopback.

PAGES_PER_CHUNK = 4
READER = """
import socket, ssl, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
if sys.argv[2] == "tls":
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
    s = ctx.wrap_socket(s)
s.sendall(b"GET /pages HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
buf = bytearray(1 << 20)
while s.recv_into(buf):
    pass
"""


def synthetic_engine(chunks: int, ops: int, page_bytes: int, emit) -> float:
    import numpy as np
    import torch

    x = torch.zeros(16)
    t0 = time.perf_counter()
    for _ in range(chunks):
        for _ in range(ops):
            x = x + 1.0
        for _ in range(PAGES_PER_CHUNK):
            page = np.empty(page_bytes, np.uint8)
            page[::4096] = 1  # a fresh page, touched
            emit(page)
    return time.perf_counter() - t0


async def synthetic_cell(args, transport: str, sender: str, stream: bool, tls_context) -> float:
    import socket
    import subprocess

    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Route

    from tandem_protocol.http_server import PageStreamProtocol, PageStreamResponse

    loop = asyncio.get_running_loop()
    frames: asyncio.Queue = asyncio.Queue()
    header = bytes(88)

    async def pages(request):
        async def gen():
            while (page := await frames.get()) is not None:
                yield (header, memoryview(page))

        return PageStreamResponse(gen())

    sock = socket.create_server(("127.0.0.1", 0))
    http = PageStreamProtocol.configured(60, sender=sender, tls=tls_context if transport == "tls" else None)
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/pages", pages)]), http=http, log_level="error"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    reader = None
    if stream:
        cmd = [sys.executable, "-c", READER, str(sock.getsockname()[1]), transport]
        if args.reader_cpus:
            cmd = ["taskset", "-c", args.reader_cpus, *cmd]
        reader = subprocess.Popen(cmd)
        await asyncio.sleep(0.5)  # connected, handshake done, waiting for pages

    def emit(page):
        if stream:
            loop.call_soon_threadsafe(frames.put_nowait, page)

    page_bytes = int(args.page_mib * (1 << 20))
    seconds = await asyncio.to_thread(synthetic_engine, args.chunks, args.ops, page_bytes, emit)
    frames.put_nowait(None)
    if reader is not None:
        await asyncio.to_thread(reader.wait, 60)
    server.should_exit = True
    await task
    return seconds


async def synthetic(args) -> dict:
    from tandem_protocol.http_server import server_tls_context
    from tandem_protocol.tls import ensure_certificate

    tls_context = server_tls_context(*ensure_certificate(Path(args.work) / "tls", "bench"))
    cells = [(t, s) for t in args.transports.split(",") for s in args.senders.split(",")]
    times = {f"{t}-{s}": {"alone": [], "pd": []} for t, s in cells}
    await synthetic_cell(args, "plain", "loop", False, tls_context)  # warm-up
    load_before, t0 = load_now(), time.time()
    for r in range(args.rounds):
        for t, s in cells if r % 2 == 0 else reversed(cells):
            for kind in ("alone", "pd") if r % 2 == 0 else ("pd", "alone"):
                sec = await synthetic_cell(args, t, s, kind == "pd", tls_context)
                times[f"{t}-{s}"][kind].append(sec)
                print(f"  round {r} {t}-{s:8s} {kind:5s} {sec * 1000:8.1f} ms", flush=True)
    return {"cells": times, "load_before": load_before, "load_after": load_now(), "wall": time.time() - t0}


def load_now() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


async def main_async(args) -> dict:
    if args.engine == "synthetic":
        got = await synthetic(args)
        rows = []
        for name, c in got["cells"].items():
            transport, sender = name.split("-")
            rows.append(row(transport, sender, c["alone"], c["pd"]))
        return {
            **header(
                args,
                f"synthetic: {args.chunks} chunks of {args.ops} torch ops + {PAGES_PER_CHUNK} pages of "
                f"{args.page_mib} MiB",
            ),
            "load_before": got["load_before"],
            "load_after": got["load_after"],
            "wall_seconds": round(got["wall"], 1),
            "rows": rows,
        }
    model = Path(args.model) if args.model else build_model(Path(args.work) / "model")
    home = Path(args.work) / "homes"
    agents = [Agent(args, model, t, s, home) for t in args.transports.split(",") for s in args.senders.split(",")]
    try:
        for a in agents:
            a.ready()
        vocab = (await agents[0].client.info()).get("vocab_size", 49152)
        rng = random.Random(7)
        ids = [rng.randrange(100, min(vocab, 49152) - 1) for _ in range(args.tokens)]
        load_before = load_now()
        t0 = time.time()
        cells = await measure(args, agents, ids)
        wall = time.time() - t0
        load_after = load_now()
        for a in agents:
            await a.client.aclose()
    finally:
        for a in agents:
            a.proc.stop() if hasattr(a.proc, "stop") else a.proc.proc.terminate()
    rows = [row(a.transport, a.sender, cells[a.name]["alone"], cells[a.name]["pd"]) for a in agents]
    return {
        **header(args, str(model)),
        "load_before": load_before,
        "load_after": load_after,
        "wall_seconds": round(wall, 1),
        "rows": rows,
    }


def row(transport: str, sender: str, alone_s: list[float], pd_s: list[float]) -> dict:
    alone, pd = statistics.median(alone_s), statistics.median(pd_s)
    return {
        "transport": transport,
        "sender": sender,
        "alone_ms": round(alone * 1000, 1),
        "pd_ms": round(pd * 1000, 1),
        "ratio": round(pd / alone, 3),
        "alone_all_ms": [round(x * 1000, 1) for x in alone_s],
        "pd_all_ms": [round(x * 1000, 1) for x in pd_s],
    }


def header(args, model: str) -> dict:
    return {
        "command": " ".join([".venv/bin/python", "bench/bench_sender.py", *sys.argv[1:]]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "engine": args.engine,
        "model": model,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "device": args.device or "cpu",
        "cpus": os.cpu_count(),
        "p_cpus": args.p_cpus,
    }


def report(result: dict) -> str:
    lines = [
        f"# Page sender: P's prefill inside P/D ÷ P alone ({result['date']})",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Engine {result['engine']}: {result['model']}"
        + (f", {result['tokens']} prompt tokens" if result["engine"] == "torch" else "")
        + f", {result['rounds']} rounds (median), "
        f"device {result['device']}, {result['cpus']} CPUs (P on {result['p_cpus'] or 'all'}); load average "
        f"before {result['load_before']}, after {result['load_after']}.",
        "",
        "| transport | sender | P alone (ms) | P in P/D (ms) | ratio |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['transport']} | {r['sender']} | {r['alone_ms']} | {r['pd_ms']} | {r['ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["torch", "synthetic"], default="torch")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=16, help="synthetic: chunks of the engine thread")
    ap.add_argument("--ops", type=int, default=2000, help="synthetic: tiny torch ops per chunk")
    ap.add_argument("--page-mib", type=float, default=8.0, help="synthetic: page size (8 MiB: an 8B model)")
    ap.add_argument("--reader-cpus", default=None, help="synthetic: taskset CPU list for the reader")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--senders", default="loop,thread")
    ap.add_argument("--transports", default="plain,tls")
    ap.add_argument("--device", default=None, help="the torch device of P (default: the agent's own choice)")
    ap.add_argument("--model", default=None, help="a checkpoint (default: the random-weight one, built once)")
    ap.add_argument("--p-cpus", default=None, help="taskset CPU list for the agents")
    ap.add_argument("--work", default="/tmp/bench-sender")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    result = asyncio.run(main_async(args))
    md = report(result)
    print(md)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"sender-{stamp}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"sender-{stamp}.md").write_text(md)


if __name__ == "__main__":
    main()

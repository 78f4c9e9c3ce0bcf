"""Page streaming between two processes on loopback vs a raw TCP copy of the same bytes.

    .venv/bin/python bench/bench_link.py [--pages 2000] [--rounds 15] [--staging 512MiB] [MODEL_DIR]

Starts a real agent (`tandem agent serve`, torch, the embedded model or MODEL_DIR), then in this
process:
- agent stream: pulls N synthetic pages (SmolLM2 geometry, 1.47 MB each) from
  GET /v1/bench/pages through the decoder's own path (AgentClient.page_stream: pages received in
  place, every checksum and expectation checked);
- raw TCP: a socket server in a thread sends the same frames with sendall, and a client
  recv_into's them into one reused buffer — the floor any HTTP transport sits above;
- raw TCP + checksum: the same, with the receiver hashing each frame (xxh3, as every page
  receiver must) in 512 KiB pieces as they land — what the check alone costs on this machine;
- raw TCP, pages kept + checksum: the same again, but each frame lands in a fresh buffer of its
  own, as a receiver that hands pages on must do (the reference's one reused 512 KiB buffer stays
  in the CPU cache; page buffers do not) — the ceiling for any page receiver, blocking, no parsing.
- stock servers (bench/link_servers.py, each in a process of its own, read the same way):
  the same pages from a Starlette app under the agent's PageStreamProtocol, under stock uvicorn
  (StreamingResponse: each frame joined, then joined again into its chunk), and from aiohttp's
  web server (StreamResponse.write) — why the agent has a writer of its own.
Prints both throughputs and their ratio (goal >= 0.9x and >= 1 GB/s), and the RSS of the agent
and of this reader during the transfer (sampled every 10 ms; baseline, peak and growth) against
2x the staging budget. The reader runs on uvloop, as the agent's own decoder side does.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import uvloop  # noqa: E402
import xxhash  # noqa: E402

from engine_adapters.embedded_model import is_fetched, model_dir  # noqa: E402
from node_agent.cli import parse_size  # noqa: E402
from tandem_cli.processes import ServiceProcess, agent_serve_args  # noqa: E402
from tandem_protocol.client import AgentClient  # noqa: E402
from tandem_protocol.pages import FrameExpectation, PageGeometry, frame_bytes, make_page  # noqa: E402
from tandem_protocol.settings import data_dir  # noqa: E402

KEY = "tdm_bench-link-key-0123456789abcdef"
SMOLLM2 = PageGeometry(layers=30, kv_heads=3, head_dim=64)


class RssSampler:
    """Highest resident set size of some processes while a `with` block runs."""

    def __init__(self, *pids: int):
        self.procs = [psutil.Process(pid) for pid in pids]
        self.baseline = [p.memory_info().rss for p in self.procs]
        self.peak = list(self.baseline)
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            for i, p in enumerate(self.procs):
                self.peak[i] = max(self.peak[i], p.memory_info().rss)

    def __enter__(self) -> RssSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def start_agent(staging: str, model: Path) -> tuple[ServiceProcess, int]:
    agent = ServiceProcess(
        agent_serve_args("torch", model, "--staging-bytes", staging), env={"TANDEM_CLUSTER_KEY": KEY}
    )
    return agent, int(agent.wait_ready().rsplit(":", 1)[1])


async def agent_stream(url: str, pages: int, expect: FrameExpectation) -> tuple[float, int]:
    client = AgentClient(url, KEY)
    try:
        count = 0
        t0 = time.perf_counter()
        async with client.page_stream("", expect, path=f"/v1/bench/pages?count={pages}") as stream:
            async for _ in stream:
                count += 1
        seconds = time.perf_counter() - t0
        assert count == pages + 1, count  # pages + the final frame
        return seconds, stream.bytes_read
    finally:
        await client.aclose()


SERVERS = {
    "tandem": "PageStreamProtocol (same app)",
    "uvicorn": "stock uvicorn",
    "aiohttp": "aiohttp",
}


def start_server(kind: str, contract: bytes) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "link_servers.py"), kind, contract.hex()],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().split()
    if line[:1] != ["ready"]:
        proc.kill()
        raise RuntimeError(f"the {kind} page server did not start")
    return proc, f"http://127.0.0.1:{line[1]}"


def raw_tcp(frame: bytes, pages: int, final: bytes, checksum: bool = False, keep: bool = False) -> tuple[float, int]:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            for _ in range(pages):
                conn.sendall(frame)
            conn.sendall(final)

    threading.Thread(target=send, daemon=True).start()
    buf = bytearray(512 * 1024)
    view, total, h = memoryview(buf), 0, xxhash.xxh3_64()
    with socket.create_connection(("127.0.0.1", port)) as s:
        t0 = time.perf_counter()
        while keep:  # frame by frame, each into its own buffer, in 512 KiB reads
            page = memoryview(np.empty(len(frame), dtype=np.uint8))
            filled = 0
            while filled < len(page) and (n := s.recv_into(page[filled : filled + len(buf)])):
                h.update(page[filled : filled + n])
                filled += n
            total += filled
            if filled < len(page):
                break
        while n := s.recv_into(view):
            total += n
            if checksum:
                h.update(view[:n])
        seconds = time.perf_counter() - t0
    server.close()
    return seconds, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=2000)
    ap.add_argument("--staging", default="512MiB")
    ap.add_argument("--rounds", type=int, default=15)  # single rounds swing ±15 % on a 2-core VM
    ap.add_argument("model", nargs="?", type=Path, help="model directory (default: the embedded model)")
    args = ap.parse_args()
    if args.model is None and not is_fetched(data_dir()):
        sys.exit("run `tandem model fetch` first")
    model = args.model or model_dir(data_dir())
    agent, port = start_agent(args.staging, model)
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        from tandem_protocol.contract import compute_contract
        from tandem_protocol.model_dir import inspect_model

        info = inspect_model(model)
        contract = compute_contract(info, info.max_context).fingerprint_bytes
        expect = FrameExpectation(contract, b"\0" * 16, b"\0" * 16, SMOLLM2)
        uvloop.run(agent_stream(f"http://127.0.0.1:{port}", 20, expect))  # warm-up
        page = make_page(SMOLLM2, 0, np.zeros(SMOLLM2.page_shape, dtype="<f2"))
        frame = frame_bytes(page, contract=contract, handoff_id=b"\0" * 16, tokens=b"\0" * 16)
        http_rates, tcp_rates, hashed_rates, kept_rates = [], [], [], []
        for kind in SERVERS:
            servers[kind] = start_server(kind, contract)
        server_rates = {kind: [] for kind in SERVERS}
        for _, url in servers.values():
            uvloop.run(agent_stream(url, 20, expect))  # warm-up
        with RssSampler(agent.proc.pid, os.getpid()) as rss:
            for _ in range(args.rounds):  # interleaved, so both see the same machine weather
                seconds, http_bytes = uvloop.run(agent_stream(f"http://127.0.0.1:{port}", args.pages, expect))
                http_rates.append(http_bytes / seconds)
                for kind, (_, url) in servers.items():
                    seconds, n = uvloop.run(agent_stream(url, args.pages, expect))
                    server_rates[kind].append(n / seconds)
                seconds, tcp_bytes = raw_tcp(frame, args.pages, b"\0" * 64)
                tcp_rates.append(tcp_bytes / seconds)
                seconds, tcp_bytes = raw_tcp(frame, args.pages, b"\0" * 64, checksum=True)
                hashed_rates.append(tcp_bytes / seconds)
                seconds, tcp_bytes = raw_tcp(frame, args.pages, b"\0" * 64, checksum=True, keep=True)
                kept_rates.append(tcp_bytes / seconds)
    finally:
        agent.stop()
        for proc, _ in servers.values():
            proc.kill()
            proc.wait()
    budget = parse_size(args.staging)
    http_rate, tcp_rate = statistics.median(http_rates), statistics.median(tcp_rates)
    print(
        f"{args.pages} pages of {SMOLLM2.page_bytes:,} bytes ({http_bytes / 1e9:.2f} GB) on loopback, "
        f"{args.rounds} interleaved rounds (median; each round's figure in brackets)"
    )
    hashed_rate = statistics.median(hashed_rates)
    print(f"raw TCP (reference)   {tcp_rate / 1e9:6.2f} GB/s   [{' '.join(f'{r / 1e9:.2f}' for r in tcp_rates)}]")
    print(
        f"raw TCP + checksum    {hashed_rate / 1e9:6.2f} GB/s   [{' '.join(f'{r / 1e9:.2f}' for r in hashed_rates)}]"
        f"   = {hashed_rate / tcp_rate:.2f}x raw TCP: the ceiling for any receiver that checks"
    )
    kept_rate = statistics.median(kept_rates)
    print(
        f"raw TCP, pages kept   {kept_rate / 1e9:6.2f} GB/s   [{' '.join(f'{r / 1e9:.2f}' for r in kept_rates)}]"
        f"   = {kept_rate / tcp_rate:.2f}x raw TCP: + each frame in a buffer of its own (any page receiver)"
    )
    print(f"agent page stream     {http_rate / 1e9:6.2f} GB/s   [{' '.join(f'{r / 1e9:.2f}' for r in http_rates)}]")
    for kind, label in SERVERS.items():
        rate = statistics.median(server_rates[kind])
        print(
            f"{label:<30s} {rate / 1e9:6.2f} GB/s   [{' '.join(f'{r / 1e9:.2f}' for r in server_rates[kind])}]"
            f"   = {rate / tcp_rate:.2f}x raw TCP"
        )
    print(
        f"ratio {http_rate / tcp_rate:.2f}x raw TCP (goal >= 0.9x and >= 1 GB/s); "
        f"per round [{' '.join(f'{h / t:.2f}' for h, t in zip(http_rates, tcp_rates))}]; "
        f"{http_rate / hashed_rate:.2f}x raw TCP + checksum, {http_rate / kept_rate:.2f}x pages kept"
    )
    mib = 2**20
    growth = [peak - base for peak, base in zip(rss.peak, rss.baseline)]
    for who, base, peak, grew in zip(("agent", "reader"), rss.baseline, rss.peak, growth):
        print(
            f"RSS {who:6s} baseline {base / mib:7,.0f} MiB  peak {peak / mib:7,.0f} MiB  "
            f"growth during transfer {grew / mib:6,.0f} MiB"
        )
    print(
        f"2x staging budget = {2 * budget / mib:,.0f} MiB: transfer growth "
        f"{'within' if max(growth) < 2 * budget else 'OVER'}; the agent's baseline is mostly model weights"
    )


if __name__ == "__main__":
    main()

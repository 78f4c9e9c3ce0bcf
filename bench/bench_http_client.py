"""httpx against aiohttp for the agent's control calls and token streams, in the same run.

    .venv/bin/python bench/bench_http_client.py [--calls 300] [--tokens 128] [--lines 50000]

Starts a real agent (`tandem agent serve`, torch, embedded model) and, for each client library
in turn (interleaved, best of --rounds, one pooled client each, as `AgentClient` keeps):
- per-request overhead: median milliseconds of GET /v1/info on a kept-alive connection;
- token stream through the agent: NDJSON lines a second of POST /v1/generate (--tokens tokens,
  greedy, ignore_eos) — what the panel reads for every request;
- the client's own ceiling: lines a second read from a local server that writes --lines NDJSON
  token lines as fast as it can (chunked, as the agent does), so the engine's pace is out of it.
Page streams are not measured here: they go through the in-place receiver either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import httpx  # noqa: E402

from engine_adapters.embedded_model import is_fetched  # noqa: E402
from tandem_cli.processes import ServiceProcess  # noqa: E402
from tandem_protocol.settings import data_dir  # noqa: E402

KEY = "tdm_bench-http-client-key-0123456789"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def start_agent() -> tuple[ServiceProcess, str]:
    agent = ServiceProcess(
        ["agent", "serve", "--engine", "torch", "--host", "127.0.0.1", "--port", "0", "--no-mdns"],
        env={"TANDEM_CLUSTER_KEY": KEY},
    )
    return agent, agent.wait_ready()


async def line_server(lines: int) -> tuple[asyncio.Server, str]:
    """A minimal HTTP/1.1 server answering every request with `lines` chunked NDJSON lines."""
    line = (json.dumps({"token": 1234, "text": " word"}) + "\n").encode()
    chunk = b"%x\r\n%s\r\n" % (len(line), line)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client closed its kept-alive connection
                writer.close()
                return
            length = next(
                (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
            )
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n")
            for i in range(lines):
                writer.write(chunk)
                if i % 64 == 0:
                    await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


class Httpx:
    name = "httpx"

    def __init__(self) -> None:
        self.c = httpx.AsyncClient(headers=HEADERS, timeout=None)

    async def info(self, url: str) -> None:
        (await self.c.get(url + "/v1/info")).raise_for_status()

    async def lines(self, url: str, body: dict) -> int:
        n = 0
        async with self.c.stream("POST", url, json=body) as r:
            async for line in r.aiter_lines():
                if line:
                    json.loads(line)
                    n += 1
        return n

    async def close(self) -> None:
        await self.c.aclose()


class Aiohttp:
    name = "aiohttp"

    def __init__(self) -> None:
        self.c = aiohttp.ClientSession(headers=HEADERS, read_bufsize=1 << 20, timeout=aiohttp.ClientTimeout(total=None))

    async def info(self, url: str) -> None:
        async with self.c.get(url + "/v1/info") as r:
            r.raise_for_status()
            await r.read()

    async def lines(self, url: str, body: dict) -> int:
        n = 0
        async with self.c.post(url, json=body) as r:
            async for line in r.content:
                if line.strip():
                    json.loads(line)
                    n += 1
        return n

    async def close(self) -> None:
        await self.c.close()


async def measure(client, agent: str, fast: str, args) -> dict:
    await client.info(agent)  # connect once: the pool keeps it
    times = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        await client.info(agent)
        times.append(time.perf_counter() - t0)
    body = {"token_ids": [1, 2, 3, 4, 5], "sampling": {"max_tokens": args.tokens, "ignore_eos": True}}
    t0 = time.perf_counter()
    n = await client.lines(agent + "/v1/generate", body)
    agent_rate = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    n = await client.lines(fast + "/lines", {})
    ceiling = n / (time.perf_counter() - t0)
    return {"info_ms": statistics.median(times) * 1000, "agent_lines_s": agent_rate, "ceiling_lines_s": ceiling}


async def run(agent: str, args) -> dict:
    server, fast = await line_server(args.lines)
    best: dict[str, dict] = {}
    try:
        for _ in range(args.rounds):
            for cls in (Httpx, Aiohttp):
                client = cls()
                try:
                    r = await measure(client, agent, fast, args)
                finally:
                    await client.close()
                b = best.setdefault(cls.name, r)
                best[cls.name] = {
                    "info_ms": min(b["info_ms"], r["info_ms"]),
                    "agent_lines_s": max(b["agent_lines_s"], r["agent_lines_s"]),
                    "ceiling_lines_s": max(b["ceiling_lines_s"], r["ceiling_lines_s"]),
                }
    finally:
        server.close()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--lines", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not is_fetched(data_dir()):
        sys.exit("run `tandem model fetch` first")
    agent, url = start_agent()
    try:
        best = asyncio.run(run(url, args))
    finally:
        agent.stop()
    print(f"{'client':8} {'GET /v1/info ms':>16} {'agent lines/s':>14} {'ceiling lines/s':>16}")
    for name, r in best.items():
        print(f"{name:8} {r['info_ms']:16.2f} {r['agent_lines_s']:14.1f} {r['ceiling_lines_s']:16.0f}")


if __name__ == "__main__":
    main()

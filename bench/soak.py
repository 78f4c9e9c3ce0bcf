"""Soak: mixed OpenAI traffic through the panel for a while, then check that nothing was kept.

    .venv/bin/python bench/soak.py [--duration 600] [--concurrency 4] [--seed 0] [--json PATH]
    TANDEM_API_KEY=K TANDEM_CLUSTER_KEY=K .venv/bin/python bench/soak.py --panel URL --agent URL --agent URL

(The keys come from the environment, never the command line, where any local user reads them.)

A server that runs for days must give back whatever a request held once that request is over,
however it ended. N workers send random requests through the panel's OpenAI API (chat and
completions, streaming or not, short and longer prompts, a few greedy tokens) to every P->D pair,
and end each one of three ways: read it to the end (complete); close the stream after a few
chunks (cancel); or give up before the answer (disconnect: a client timeout, or the connection
closed right after the request was sent). Then it measures:

- leaks: once the load stops, every agent must come back to idle (nothing reserved in the staging
  budget or waiting for it, no open handoff, no active request) within --settle seconds, and the
  panel's request log must have no row still "running" (goal: nothing held);
- memory: each process's RSS after the warm-up (the first --warmup fraction of the run, read once
  the agents are idle) against its RSS at the end, idle again (goal: growth under 10%): both
  readings without a request in flight, so what grew is memory kept after requests;
- errors: a 5xx, an error event in a stream, or a stream that broke without the soak breaking it
  (goal: none). A 429 (the prefiller's budget busy) is counted, not failed.

By default it starts its own cluster on loopback, the way `tandem bench ttft` does: two agents on
the embedded model (--engines, torch and MLX) and a panel with a pair each way. With --panel it
soaks an existing cluster instead; RSS then comes from the agents' /v1/status alone (no panel):
each agent's own and, apart, that of the engine server it runs (vLLM, SGLang); the request log is
read only where --panel-db names the panel's database. Prints the tables, writes the same as JSON with --json, and
exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import ssl
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from engine_adapters.embedded_model import is_fetched, model_dir  # noqa: E402
from tandem_protocol.settings import data_dir  # noqa: E402

RSS_GOAL_PERCENT = 10.0
REQUEST_TIMEOUT = 300.0  # a request the soak does not cut itself; longer is a stall (an error)
ACTIONS = {"complete": 0.5, "cancel": 0.25, "disconnect": 0.25}  # action: weight
OUTCOMES = ("ok", "cancelled", "disconnected", "429", "error")
SENTENCES = [
    "Explain how a river delta forms and why it spreads into many channels.",
    "Why does the Moon always show the same face to the Earth?",
    "Describe what a hash table does when two keys collide.",
    "Tell me how bread rises in a warm kitchen and what the yeast is doing.",
    "List five capital cities in Europe with one fact about each of them.",
    "Write a haiku about autumn rain falling on an old tin roof.",
    "Translate 'good morning' into French, German and Japanese.",
    "Summarise the causes of the First World War for a twelve-year-old reader.",
    "Compare the water cycle with the carbon cycle in a few plain sentences.",
    "Describe how the gears of a bicycle let a rider climb a steep hill.",
    "Give three tips for growing tomatoes on a small balcony in the city.",
    "Explain what inflation means for the savings in a bank account.",
    "Tell a short story about a lighthouse keeper who finds a message in a bottle.",
    "What is the difference between weather and climate, with one example?",
    "How does a refrigerator move heat out of its cold inside?",
    "Why do cats purr, and do they only purr when they are happy?",
]
console = Console()


# ---- the cluster under load -----------------------------------------------------------------------
@dataclass
class Target:
    url: str  # the panel's
    api_key: str
    agents: dict[str, str]  # name: URL
    cluster_key: str | None
    pids: dict[str, int] = field(default_factory=dict)  # name: process id, when the soak started them
    panel_db: Path | None = None  # panel.db: the soak started the panel, or --panel-db


@contextmanager
def own_cluster(engines: tuple[str, str], pin: bool) -> Iterator[Target]:
    """Two agents on loopback (prefill engine first) and a panel with a pair each way, in a
    temporary home that goes when the soak ends. Pinned, each agent has a CPU of its own (on two
    cores, two agents' thread pools competing for both make every step several times slower)."""
    from tandem_cli.bench_ttft import cluster, loopback_link

    if not is_fetched(data_dir()):
        sys.exit("run `tandem model fetch` first")
    key = "tdm_soak-" + secrets.token_hex(16)
    with ExitStack() as stack:
        with console.status(f"starting two agents ({engines[0]}, {engines[1]}) and a panel…"):
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tandem-soak-")))
            link = stack.enter_context(loopback_link())
            c = stack.enter_context(
                cluster(model_dir(data_dir()), engines, link, home, key, pin, directions=[(0, 1), (1, 0)])
            )
        yield Target(
            c.url,
            c.api_key,
            {a.name: a.url for a in c.agents},
            key,
            pids={"panel": c.panel_pid, **{a.name: a.pid for a in c.agents}},
            panel_db=c.panel_home / "panel.db",
        )


def existing_cluster(args: argparse.Namespace) -> Target:
    """A running cluster: the panel, and the agents under it (named as they name themselves)."""
    agents = {}
    for url in args.agent or []:
        r = httpx.get(url.rstrip("/") + "/v1/status", headers=bearer(args.cluster_key), timeout=30, verify=tls())
        r.raise_for_status()
        agents[r.json()["name"]] = url.rstrip("/")
    return Target(args.panel.rstrip("/"), args.api_key, agents, args.cluster_key, panel_db=args.panel_db)


def tls() -> ssl.SSLContext:
    """Trust as the cluster's own services do: TANDEM_CA_FILE when set (a self-signed cluster)."""
    return ssl.create_default_context(cafile=os.environ.get("TANDEM_CA_FILE"))


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def pair_names(http: httpx.AsyncClient, target: Target) -> list[str]:
    """Every P->D pair the panel serves (its model list, less the single nodes)."""
    r = await http.get(target.url + "/v1/models", headers=bearer(target.api_key))
    r.raise_for_status()
    return sorted(m["id"] for m in r.json()["data"] if not m["id"].startswith("node/"))


# ---- one request ------------------------------------------------------------------------------------
@dataclass
class Call:
    action: str
    path: str  # /v1/chat/completions or /v1/completions
    body: dict
    cancel_after: int = 0  # chunks read before closing the stream (cancel)
    disconnect: str = ""  # "timeout" or "close" (disconnect)
    timeout: float = 0.0  # seconds before the client gives up (disconnect by timeout)


def prompt(rng: random.Random, long: bool) -> str:
    """One sentence, or a dozen and more (a few hundred tokens: several pages, two prefill chunks)."""
    picked = [rng.choice(SENTENCES)] if not long else rng.sample(SENTENCES, 12) + rng.sample(SENTENCES, 6)
    return f"({rng.randrange(10**6)}) " + " ".join(picked)  # a number up front: no two prompts alike


def plan(rng: random.Random, models: list[str]) -> Call:
    """A random request and the way it will end."""
    action = rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
    chat = rng.random() < 0.5
    stream = action == "cancel" or rng.random() < 0.5
    max_tokens = {"complete": rng.choice([1, 2, 4, 8]), "cancel": 16, "disconnect": 8}[action]
    body = {"model": rng.choice(models), "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    text = prompt(rng, long=rng.random() < 0.3)
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    call = Call(action, "/v1/chat/completions" if chat else "/v1/completions", body)
    if action == "cancel":
        call.cancel_after = rng.randint(1, 3)
    elif action == "disconnect":
        call.disconnect = rng.choice(["timeout", "close"])
        call.timeout = rng.uniform(0.02, 0.5)
    return call


def http_outcome(status: int, text: str) -> tuple[str, str]:
    if status == 200:
        return "ok", ""
    if status == 429:
        return "429", text[:200]
    return "error", f"HTTP {status}: {text[:200]}"


async def read_stream(r: httpx.Response, stop_after: int) -> tuple[str, str]:
    """Server-sent events to [DONE], or "cancelled" after `stop_after` chunks (0: never)."""
    chunks = 0
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return "ok", ""
        event = json.loads(line[6:])
        if "error" in event:
            return "error", f"error in the stream: {event['error'].get('message')}"
        chunks += 1
        if chunks == stop_after:
            return "cancelled", ""  # the caller closes the response: the connection goes with it
    return "error", "the stream ended without [DONE]"


async def send(http: httpx.AsyncClient, call: Call) -> tuple[str, str]:
    """The request, read to the end, or to `cancel_after` chunks of its stream."""
    try:
        if call.body["stream"]:
            async with http.stream("POST", call.path, json=call.body) as r:
                if r.status_code != 200:
                    return http_outcome(r.status_code, (await r.aread()).decode(errors="replace"))
                return await read_stream(r, call.cancel_after)
        r = await http.post(call.path, json=call.body)
        return http_outcome(r.status_code, r.text)
    except httpx.HTTPError as e:
        return "error", f"{type(e).__name__}: {e}"


async def send_and_close(target: Target, call: Call) -> tuple[str, str]:
    """The request's bytes on a raw connection, closed at once without reading anything."""
    url = httpx.URL(target.url)
    https = url.scheme == "https"
    body = json.dumps(call.body).encode()
    head = (
        f"POST {call.path} HTTP/1.1\r\nHost: {url.netloc.decode()}\r\nAuthorization: Bearer {target.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    _, writer = await asyncio.open_connection(
        url.host, url.port or (443 if https else 80), ssl=tls() if https else None
    )
    writer.write(head.encode() + body)
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    return "disconnected", ""


async def run_call(http: httpx.AsyncClient, target: Target, call: Call) -> tuple[str, str]:
    if call.disconnect == "close":
        return await send_and_close(target, call)
    if call.disconnect == "timeout":
        try:
            return await asyncio.wait_for(send(http, call), call.timeout)
        except TimeoutError:
            return "disconnected", ""
    return await send(http, call)


# ---- the load ---------------------------------------------------------------------------------------
@dataclass
class Tally:
    counts: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))  # action: outcomes
    first: dict[str, str] = field(default_factory=dict)  # outcome: its first message

    def add(self, action: str, outcome: str, message: str) -> None:
        self.counts[action][outcome] += 1
        if message:
            self.first.setdefault(outcome, message)

    def total(self, outcome: str) -> int:
        return sum(c[outcome] for c in self.counts.values())


async def worker(
    http: httpx.AsyncClient, target: Target, models: list[str], rng: random.Random, stop_at: float, tally: Tally
) -> None:
    while time.monotonic() < stop_at:
        call = plan(rng, models)
        tally.add(call.action, *await run_call(http, target, call))


async def load(
    http: httpx.AsyncClient, target: Target, models: list[str], rngs: list[random.Random], seconds: float, tally: Tally
) -> None:
    """A worker per RNG for `seconds`; returns once the requests in flight then have ended."""
    stop_at = time.monotonic() + seconds
    await asyncio.gather(*(worker(http, target, models, rng, stop_at, tally) for rng in rngs))


async def rss(http: httpx.AsyncClient, target: Target) -> dict[str, int]:
    """Resident bytes of each process: measured here for those the soak started, else as each
    agent reports its own."""
    if target.pids:
        return {name: psutil.Process(pid).memory_info().rss for name, pid in target.pids.items()}
    out = {}
    for name, url in target.agents.items():
        process = (await agent_status(http, target, url))["process"]
        out[name] = process["rss_bytes"]
        if process.get("children_rss_bytes"):  # an engine that runs as its own server (vLLM, SGLang)
            out[f"{name} engine"] = process["children_rss_bytes"]
    return out


async def agent_status(http: httpx.AsyncClient, target: Target, url: str) -> dict:
    r = await http.get(url + "/v1/status", headers=bearer(target.cluster_key))
    r.raise_for_status()
    return r.json()


def running_rows(db: Path) -> int:
    """Request-log rows still "running" (in flight, as the panel sees it)."""
    from sqlalchemy import func
    from sqlmodel import Session, create_engine, select

    from control_panel.models import RequestLog

    engine = create_engine(f"sqlite:///{db}")
    try:
        with Session(engine) as s:
            return s.exec(select(func.count()).select_from(RequestLog).where(RequestLog.outcome == "running")).one()
    finally:
        engine.dispose()


async def held(http: httpx.AsyncClient, target: Target) -> dict[str, dict[str, int]]:
    """What each agent (and the panel's request log) holds now."""
    out = {}
    for name, url in target.agents.items():
        s = await agent_status(http, target, url)
        out[name] = {
            "budget.reserved": s["budget"]["reserved"],
            "budget.waiting": s["budget"]["waiting"],
            "open_handoffs": s["open_handoffs"],
            "active_requests": s["active_requests"],
        }
    if target.panel_db:
        out["panel"] = {"running request-log rows": running_rows(target.panel_db)}
    return out


async def settle(http: httpx.AsyncClient, target: Target, timeout: float) -> dict[str, dict[str, int]]:
    """Poll until nothing is held or the deadline passes; what is still held then is a leak."""
    deadline = time.monotonic() + timeout
    while True:
        now = await held(http, target)
        if not any(v for counts in now.values() for v in counts.values()) or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.25)


async def soak(target: Target, args: argparse.Namespace) -> dict:
    """The warm-up, then the baseline RSS once the agents are idle; the rest of the load, then the
    leaks and the end RSS once they are idle again. Both RSS readings are taken idle, so the
    growth between them is what requests left behind, not what requests in flight were using."""
    async with httpx.AsyncClient(
        base_url=target.url, headers=bearer(target.api_key), timeout=REQUEST_TIMEOUT, verify=tls()
    ) as http:
        models = args.model or await pair_names(http, target)
        if not models:
            sys.exit("the panel serves no P->D pair")
        tally = Tally()
        rngs = [random.Random(args.seed * 1000 + i) for i in range(args.concurrency)]
        warm = args.duration * args.warmup
        started = time.monotonic()
        with console.status(f"warming up for {warm:.0f} s ({', '.join(models)}, {args.concurrency} workers)…"):
            await load(http, target, models, rngs, warm, tally)
            await settle(http, target, args.settle)
            baseline = await rss(http, target)
        with console.status(f"soaking for {args.duration - warm:.0f} s more…"):
            await load(http, target, models, rngs, args.duration - warm, tally)
        load_seconds = time.monotonic() - started
        with console.status("waiting for the agents to settle…"):
            left = await settle(http, target, args.settle)
            end = await rss(http, target)
    return result(args, target, models, tally, load_seconds, baseline, end, left)


# ---- the report -------------------------------------------------------------------------------------
def result(
    args,
    target: Target,
    models: list[str],
    tally: Tally,
    load_seconds: float,
    baseline: dict[str, int],
    end: dict[str, int],
    left: dict[str, dict[str, int]],
) -> dict:
    memory = {
        name: {
            "baseline_bytes": baseline[name],
            "end_bytes": end[name],
            "growth_percent": round((end[name] - baseline[name]) / baseline[name] * 100, 2),
        }
        for name in baseline
    }
    leaks = [f"{who}: {what} = {n}" for who, counts in left.items() for what, n in counts.items() if n]
    out = {
        "duration_seconds": args.duration,
        "load_seconds": round(load_seconds, 1),
        "concurrency": args.concurrency,
        "seed": args.seed,
        "cluster": "own" if target.pids else target.url,
        "models": models,
        "requests": {a: dict(tally.counts[a]) for a in ACTIONS},
        "total_requests": sum(sum(c.values()) for c in tally.counts.values()),
        "first_messages": tally.first,
        "rss": memory,
        "held_after_settle": left,
        "leaks": leaks,
    }
    out["goals_missed"] = goals_missed(out, tally)
    return out


def goals_missed(out: dict, tally: Tally) -> list[str]:
    missed = [
        f"RSS of {name} grew {m['growth_percent']:.1f}% (goal < {RSS_GOAL_PERCENT:.0f}%)"
        for name, m in out["rss"].items()
        if m["growth_percent"] >= RSS_GOAL_PERCENT
    ]
    missed += [f"leak: {leak}" for leak in out["leaks"]]
    if tally.total("error"):
        missed.append(f"{tally.total('error')} unexpected errors, the first: {tally.first.get('error')}")
    if not tally.total("ok"):
        missed.append("no request completed")
    return missed


def show(out: dict) -> None:
    table = Table(
        title=f"Requests ({out['total_requests']} in {out['load_seconds']} s, "
        f"{out['concurrency']} workers, {', '.join(out['models'])})"
    )
    table.add_column("action")
    for outcome in (*OUTCOMES, "total"):
        table.add_column(outcome, justify="right")
    for action, counts in out["requests"].items():
        table.add_row(action, *(str(counts.get(o, 0)) for o in OUTCOMES), str(sum(counts.values())))
    console.print(table)
    for outcome, message in out["first_messages"].items():
        console.print(f"first {outcome}: {message}", markup=False)

    table = Table(
        title=f"RSS, idle after the warm-up (baseline) and at the end (goal: growth < {RSS_GOAL_PERCENT:.0f}%)"
    )
    for name in ("process", "baseline MB", "end MB", "growth"):
        table.add_column(name, justify="left" if name == "process" else "right")
    for name, m in out["rss"].items():
        table.add_row(
            name, f"{m['baseline_bytes'] / 1e6:.1f}", f"{m['end_bytes'] / 1e6:.1f}", f"{m['growth_percent']:+.1f}%"
        )
    console.print(table)

    console.print(f"leaks after settling: {len(out['leaks'])}" + "".join(f"\n  {x}" for x in out["leaks"]))
    if out["goals_missed"]:
        console.print("[bold red]goals missed:[/]" + "".join(f"\n  {x}" for x in out["goals_missed"]))
    else:
        console.print("[bold green]every goal met[/]")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=4, help="workers, each one request at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the run before the baseline RSS")
    ap.add_argument("--settle", type=float, default=60, help="seconds the agents get to come back to idle")
    ap.add_argument("--json", type=Path, help="write the result here too")
    ap.add_argument("--engines", default="torch,mlx", help="own cluster: engines of agents a and b")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="own cluster: do not pin each agent to a CPU")
    ap.add_argument("--panel", help="soak this panel instead of starting a cluster")
    ap.add_argument("--agent", action="append", help="with --panel: an agent URL to check (repeatable)")
    ap.add_argument(
        "--panel-db",
        type=Path,
        help="with --panel, on the panel's machine: its panel.db, so that no request-log row may be left running",
    )
    ap.add_argument("--model", action="append", help="pair names to use (default: every pair of the panel)")
    args = ap.parse_args()
    # keys from the environment: a command line is readable by every local user (`ps`)
    args.api_key, args.cluster_key = os.environ.get("TANDEM_API_KEY"), os.environ.get("TANDEM_CLUSTER_KEY")
    if args.panel and not args.api_key:
        ap.error("--panel needs the panel's API key in TANDEM_API_KEY")
    if args.agent and not args.cluster_key:
        ap.error("--agent needs the cluster key in TANDEM_CLUSTER_KEY")
    if len(args.engines.split(",")) != 2:
        ap.error("--engines takes two engines, e.g. torch,mlx")
    return args


def main() -> None:
    args = parse_args()
    if args.panel:
        out = asyncio.run(soak(existing_cluster(args), args))
    else:
        with own_cluster(tuple(args.engines.split(",")), args.pin) as target:
            out = asyncio.run(soak(target, args))
    show(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    sys.exit(1 if out["goals_missed"] else 0)


if __name__ == "__main__":
    main()

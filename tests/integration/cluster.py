"""The integration tier's cluster: one agent per engine role, a panel with a pair for every direction
the tier checks, and a TamperProxy in front of the prefiller of each fault pair. Started once for
the tier (tests/integration/conftest.py) and reused by every scenario."""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import openai

from ..agents import AgentProcess, PanelProcess, TamperProxy, complete, log_rows, reserved_port, settle, wait_for

# A page stream silent this long is broken (the agents' --stall-timeout). Heartbeats cover a
# prefiller's compute between pages; this also bounds how long a decoder may leave queued pages
# unread while its one engine finishes earlier requests (test_load's queues on two cores).
STALL_SECONDS = "30"

# An agent's log lines worth showing when a test fails (tracebacks, warnings, failed requests,
# its engine's exits and restarts).
NOTABLE = re.compile(r"WARNING|ERROR|CRITICAL|Traceback|Error\b|failed|refused|rejected|exited|restart")

# name -> (engine, environment). SGLang starts one agent in each of its roles (either switches when
# asked for the other, slowly), so SGLang prefills on "sglang" and decodes on "sglang2".
AGENTS = {
    "torch": ("torch", {}),
    "mlx": ("mlx", {}),
    "vllm": ("vllm", {}),
    "vllm2": ("vllm", {}),
    "sglang": ("sglang", {"TANDEM_SGLANG_ROLE": "prefill"}),
    "sglang2": ("sglang", {"TANDEM_SGLANG_ROLE": "decode"}),
}

# Every direction between the four engines (P, D); the same-engine ones run between two agents.
DIRECTIONS = [
    ("torch", "mlx"),
    ("mlx", "torch"),
    ("vllm", "mlx"),
    ("mlx", "vllm"),
    ("vllm", "torch"),
    ("torch", "vllm"),
    ("vllm", "vllm2"),
    ("sglang", "mlx"),
    ("mlx", "sglang2"),
    ("sglang", "torch"),
    ("torch", "sglang2"),
    ("sglang", "sglang2"),
    ("sglang", "vllm"),
    ("vllm", "sglang2"),
]
# The pairs the fault scenarios run on, one per engine family (the prefiller's side is proxied).
FAULT_PAIRS = [("mlx", "torch"), ("vllm", "vllm2"), ("sglang", "sglang2")]

# What each server engine's own KV pool reads when it holds nothing (its agent's engine_stats).
# The in-process engines' memory is the agent's own: settle() covers it.
POOL_IDLE = {"vllm": {"kv_cache_usage": 0.0}, "sglang": {"kv_tokens_used": 0}}
READY_STAT = {"vllm": "kv_cache_usage", "sglang": "kv_tokens_used"}


def pair_name(p: str, d: str) -> str:
    return f"{p}-to-{d}"


class Cluster:
    """The agents (by name, `cluster["vllm"]`), the panel, one OpenAI client for it, the proxies."""

    def __init__(self, model: Path, home: Path, stack: ExitStack):
        self.model, self.home, self.panel_home = model, home, home / "panel"
        # equal thread counts: same-engine outputs comparable bit for bit
        os.environ.setdefault("TANDEM_VLLM_THREADS", "1")
        os.environ.setdefault("TANDEM_SGLANG_THREADS", "1")
        # each fault pair's prefiller is reached through a proxy on a port held from now on: the
        # agent advertises it, so it can prove its identity to the panel there
        reserved = {pair: reserved_port() for pair in FAULT_PAIRS}
        proxy_ports = {pair: sock.getsockname()[1] for pair, sock in reserved.items()}
        started = {}
        for name, (engine, env) in AGENTS.items():  # all at once: server engines take most of a minute
            advertised = [
                a
                for (p, _), port in proxy_ports.items()
                if p == name
                for a in ("--advertise-address", f"127.0.0.1:{port}")
            ]
            started[name] = AgentProcess(
                engine, model, home / name, "--stall-timeout", STALL_SECONDS, *advertised, env=env
            )
            stack.callback(started[name].stop)
        for agent in started.values():  # four engine servers loading side by side on two cores: minutes
            agent.wait_ready(900)
        self.agents = started
        self.proxies: dict[tuple[str, str], TamperProxy] = {}
        for p, d in FAULT_PAIRS:
            self.proxies[(p, d)] = TamperProxy(self[p].port, sock=reserved[(p, d)])
            stack.callback(self.proxies[(p, d)].close)
        self.start_panel(*self.pair_args(DIRECTIONS))
        stack.callback(lambda: self.panel.stop())  # whichever panel runs by then (see the restart)

    def pair_args(self, directions: list[tuple[str, str]], proxied: bool = False) -> list[str]:
        """The panel's --pair options for `directions`; `proxied`: each fault pair's prefiller at
        its proxy's address."""
        proxies = {p: proxy.url for (p, _), proxy in self.proxies.items()} if proxied else {}
        return [
            a
            for p, d in directions
            for a in ("--pair", f"{pair_name(p, d)}={proxies.get(p, self[p].url)},{self[d].url},threshold=1")
        ]

    @contextmanager
    def through_proxies(self):
        """The fault pairs' prefillers reached through their proxies (which pass bytes untouched
        until a test sets a fault) while the block runs, directly again after. A node has one
        address, so the panel is restarted with the pairs at the proxies' addresses: the
        prefillers prove their identity there (they advertise them) and their nodes move, for
        every pair they are in; the other scenarios keep the direct path."""
        self.panel.stop()
        self.start_panel(*self.pair_args(FAULT_PAIRS, proxied=True))
        try:
            yield
        finally:
            self.panel.stop()
            self.start_panel(*self.pair_args(FAULT_PAIRS))

    def __getitem__(self, name: str) -> AgentProcess:
        return self.agents[name]

    def start_panel(self, *args: str) -> None:
        """A panel on the cluster's panel home (its pairs are kept there), and a client for it."""
        self.panel = PanelProcess(self.panel_home, *args)
        self.api_key = self.panel.api_key or self.api_key  # a panel prints a new key only once
        self.client = openai.OpenAI(base_url=self.panel.url + "/v1", api_key=self.api_key, max_retries=0, timeout=300)

    def log(self) -> list:
        return log_rows(self.panel_home)

    def last_row(self, model: str | None = None):
        """The newest request's row (of `model`'s requests, if given: other pairs may be busy at
        the same time) once it is final (a streaming client may see [DONE] a moment before the
        panel has written how the request ended)."""

        def final():
            rows = [r for r in self.log() if model is None or r.model == model]
            return rows[-1] if rows and rows[-1].outcome != "running" else None

        return wait_for(final, 10)

    def diagnosis(self, rows: int = 3, lines: int = 8) -> str:
        """What a failed test's reader needs and CI's output would otherwise lack: the panel's
        newest failed requests (each error names the node and what it answered) and the newest
        notable log lines of the agents those requests touched (of every agent if none did)."""
        failed = [r for r in self.log() if r.outcome == "error"][-rows:]
        out = [f"panel {r.request_id} {r.route} {r.prefill_node or '-'}->{r.decode_node}: {r.error}" for r in failed]
        named = {n for r in failed for n in (r.prefill_node, r.decode_node) if n}
        agents = [a for a in self.agents.values() if a.name in named] or list(self.agents.values())
        for agent in agents:
            notable = [line.rstrip()[:400] for line in agent.log if NOTABLE.search(line)][-lines:]
            out += [f"{agent.name}: {line}" for line in notable]
        return "\n".join(out) or "no failed request in the panel's log and nothing notable in the agents' logs"

    def alone(self, decoder: str, ids: list[int], max_tokens: int = 16) -> str:
        """The decoder's own answer through the panel (its node's model): what a fallback must give."""
        return complete(self.client, f"node/{self[decoder].engine}-{decoder}", ids, False, max_tokens)

    def idle(self, *names: str, timeout: float = 30) -> None:
        """The agents idle (nothing reserved, no handoff, no request holding engine memory) and each
        server engine's own KV pool back to empty (it frees on its own schedule)."""
        agents = [self[n] if isinstance(n, str) else n for n in names]
        settle(*agents, timeout=timeout)
        for agent in agents:
            idle = POOL_IDLE.get(agent.engine, {})
            wait_for(lambda a=agent, i=idle: all(a.status()["engine_stats"][k] == v for k, v in i.items()), timeout)


def ask_in_thread(client, model: str, ids: list[int], result: dict, max_tokens: int = 16) -> threading.Thread:
    """complete() on `model` in a started thread; its text, or the exception the client saw, lands
    in `result` ("text" / "error")."""

    def go() -> None:
        try:
            result["text"] = complete(client, model, ids, False, max_tokens)
        except Exception as e:  # what the client saw is what the test checks
            result["error"] = e

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def kill_engine_server(agent: AgentProcess, timeout: float = 300) -> dict:
    """SIGKILL the agent's engine server; wait until the agent has started it again and it
    answers. Returns the engine stats then."""
    stats = agent.status()["engine_stats"]
    os.kill(stats["pid"], 9)
    ready, restarts = READY_STAT[agent.engine], stats["restarts"]

    def restarted():
        stats = agent.status()["engine_stats"]
        return stats if stats["restarts"] == restarts + 1 and stats[ready] is not None and stats["pid"] else None

    return wait_for(restarted, timeout, step=0.5)


def streaming_chunks(client, model: str, ids: list[int], result: dict, max_tokens: int = 400) -> threading.Thread:
    """A streaming completion in a started thread, counting chunks in result["chunks"]; the
    exception the client saw, if any, in result["error"]."""
    result["chunks"] = 0

    def go() -> None:
        try:
            for _ in client.completions.create(
                model=model, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True
            ):
                result["chunks"] += 1
        except Exception as e:  # what the client saw is what the test checks
            result["error"] = e

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def wait_while_alive(thread: threading.Thread, what, timeout: float = 120) -> None:
    """Until what() holds; fails at once if `thread` ended first."""
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline and thread.is_alive(), "the request ended before the moment to act"
        time.sleep(0.02)


# Decoders that decode a batch exactly as they decode one request (tests/system/test_batching.py).
# vLLM's and SGLang's CPU kernels depend on the batch: a greedy near-tie may flip under load.
EXACT = ("torch", "mlx")


def for_each(decoder: str, fn, items: list) -> list:
    """`fn(item)` for every item: all at once into an exact decoder, else one at a time. (The
    panel's SDK client is safe to share between threads.)"""
    if decoder not in EXACT:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))

"""A prompt whose KV is 4× the prefiller's staging budget, on every prefill engine (issue 23): the
budget bounds the pages in host memory (a window), not the prompt. Each prefiller's budget is cut
to WINDOW pages (POST /v1/config: same engine and model, nothing reloads) and its decoder reads
through a proxy shaped to RATE, slower than the prefill, so the window fills and export waits on
the link. Sampled all along: the pages the prefiller holds never exceed the budget, and they do
reach it (the window was what bounded them). The output is the same pair's with the default
budget on a fast link, token for token. A cancel while the window is full and the link frozen
frees everything: the prefiller's budget, its engine (a server engine's own KV pool too)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest

from tandem_cli.bench_ttft import prompt_ids
from tandem_protocol.client import AgentClient

from ..agents import TEST_KEY, TamperProxy, pd_request, tokens_of, wait_for
from ..conftest import run

PAGE_BYTES = 1_474_560
WINDOW = 4  # pages of staging budget
PAGES = 16  # pages of the prompt's KV: 4× the budget
TOKENS = PAGES * 64 - 20
RATE = 8e6  # bytes/s on the proxied link: ~0.2 s a page, slower than any prefiller's pages
SAMPLING = {"max_tokens": 8, "ignore_eos": True}

# prefiller -> decoder (another agent: the pages cross a real link)
PAIRS = {"torch": "mlx", "mlx": "torch", "vllm": "torch", "sglang": "torch"}


@contextmanager
def budget(agent, model: str, nbytes: int):
    def set_to(n: int) -> None:
        with agent.client() as c:
            r = c.post("/v1/config", json={"engine": agent.engine, "model_path": model, "staging_bytes": n})
            assert r.status_code == 200 and not r.json().get("loading"), r.text

    original = agent.status()["budget"]["capacity"]
    set_to(nbytes)
    try:
        yield
    finally:
        set_to(original)


class Sampler(threading.Thread):
    """The prefiller's budget figures every 20 ms while a request runs."""

    def __init__(self, agent):
        super().__init__(daemon=True)
        self.agent, self.samples, self.stop = agent, [], threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stop.is_set():
            b = self.agent.status()["budget"]
            self.samples.append((b["staged"], b["reserved"], b["capacity"]))
            time.sleep(0.02)

    def done(self) -> list[tuple[int, int, int]]:
        self.stop.set()
        self.join()
        return self.samples


@pytest.mark.parametrize("p", list(PAIRS))
def test_a_prompt_4x_the_staging_budget_streams_through_the_window(cluster, smol_dir, p):
    P, D = cluster[p], cluster[PAIRS[p]]
    ids = prompt_ids(TOKENS, seed=23, vocab=49152)
    expected = tokens_of(run(pd_request(P.url, D.url, ids, SAMPLING)))  # the default budget, fast link
    proxy = TamperProxy(P.port)
    proxy.set_faults(rate=RATE)
    try:
        with budget(P, str(smol_dir), WINDOW * PAGE_BYTES):
            sampler = Sampler(P)
            lines = run(pd_request(P.url, D.url, ids, SAMPLING, prefill_url=proxy.url))
            samples = sampler.done()
    finally:
        proxy.close()
    assert tokens_of(lines) == expected
    staged = [s for s, _, _ in samples]
    assert all(s <= r <= c == WINDOW * PAGE_BYTES for s, r, c in samples), samples
    assert max(staged) == WINDOW * PAGE_BYTES, f"the window never filled: {max(staged):,} bytes at most"
    cluster.idle(p, PAIRS[p])


async def cancel(agent, handoff_id: str) -> dict:
    client = AgentClient(agent.url, TEST_KEY)
    try:
        return await client.cancel_handoff(handoff_id)
    finally:
        await client.aclose()


@pytest.mark.parametrize("p", list(PAIRS))
def test_cancel_with_the_window_full_frees_everything(cluster, smol_dir, p):
    P, D = cluster[p], cluster[PAIRS[p]]
    ids = prompt_ids(TOKENS, seed=24, vocab=49152)
    proxy = TamperProxy(P.port)
    proxy.set_faults(freeze_at=2 * PAGE_BYTES)  # the link goes silent after two pages
    try:
        with budget(P, str(smol_dir), WINDOW * PAGE_BYTES):
            request = threading.Thread(
                target=lambda: run(pd_request(P.url, D.url, ids, SAMPLING, prefill_url=proxy.url)), daemon=True
            )
            request.start()
            full = wait_for(lambda: (s := P.status())["budget"]["staged"] == WINDOW * PAGE_BYTES and s, 120, 0.05)
            (handoff,) = full["handoffs"]
            assert handoff["pages_sent"] < PAGES
            assert run(cancel(P, handoff["handoff_id"]))["cancelled"]
            request.join(60)
            assert not request.is_alive(), "the decode did not end after its handoff was cancelled"
    finally:
        proxy.close()
    cluster.idle(p, PAIRS[p])

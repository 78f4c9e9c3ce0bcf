"""A prompt whose KV is 4× the prefiller's staging budget, on every prefill engine (issue 23): the
budget bounds the pages in host memory (a window), not the prompt. Each prefiller's budget is cut
to WINDOW pages (POST /v1/config: same engine and model, nothing reloads) and its decoder reads
through a proxy shaped to RATE, slower than the prefill, so the window fills and export waits on
the link. Sampled all along: the pages the prefiller holds never exceed the budget. The output is
the same pair's with the default budget on a fast link, token for token. With the link frozen
after two pages the window fills and stays full (the engine's export waits: what the buffers
between absorb is not counted, which is why a merely slow link may never fill it), and a cancel
then frees everything: the prefiller's budget, its engine (a server engine's own KV pool too)."""

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
WINDOW = 2  # pages of staging budget (was 3, 4 before; a window is counted in pages, any >= 1 works)
# pages of the prompt's KV: 4× the budget (was 12, 16 before: the same ratio on 2/3 of the prefill)
PAGES = 4 * WINDOW
# the cancel's prompt: frozen after two pages, the socket buffers between take up to ~3.2 more (a
# 4 MiB send buffer, a 512 kB receive buffer), so 2 + 3.2 + the window's 2 leave ~4 pages spare
# for the window to fill (as 12 did beside a window of 3)
CANCEL_PAGES = 11
RATE = 8e6  # bytes/s on the proxied link: ~0.2 s a page, slower than any prefiller's pages
# a wrong page shows in the first tokens (was 8)
SAMPLING = {"max_tokens": 4, "ignore_eos": True}

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
    ids = prompt_ids(PAGES * 64 - 20, seed=23, vocab=49152)
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
    assert samples and all(s <= r <= c == WINDOW * PAGE_BYTES for s, r, c in samples), samples
    cluster.idle(p, PAIRS[p])


def held_full(agent) -> dict | None:
    """The prefiller's status once its window is full and stays so for a second with no page sent
    (the buffers between the frozen link and the window have filled too), else None."""
    a = agent.status()
    time.sleep(1.0)
    b = agent.status()
    full = WINDOW * PAGE_BYTES
    if not (a["handoffs"] and b["handoffs"] and a["budget"]["staged"] == b["budget"]["staged"] == full):
        return None
    sent = a["handoffs"][0]["pages_sent"]
    return b if sent == b["handoffs"][0]["pages_sent"] < CANCEL_PAGES else None


async def cancel(agent, handoff_id: str) -> dict:
    client = AgentClient(agent.url, TEST_KEY)
    try:
        return await client.cancel_handoff(handoff_id)
    finally:
        await client.aclose()


@pytest.mark.parametrize("p", list(PAIRS))
def test_cancel_with_the_window_full_frees_everything(cluster, smol_dir, p):
    P, D = cluster[p], cluster[PAIRS[p]]
    ids = prompt_ids(CANCEL_PAGES * 64 - 20, seed=24, vocab=49152)
    proxy = TamperProxy(P.port)
    proxy.set_faults(freeze_at=2 * PAGE_BYTES)  # the link goes silent after two pages
    try:
        with budget(P, str(smol_dir), WINDOW * PAGE_BYTES):
            request = threading.Thread(
                target=lambda: run(pd_request(P.url, D.url, ids, SAMPLING, prefill_url=proxy.url)), daemon=True
            )
            request.start()
            full = wait_for(lambda: held_full(P), 120, 0.05)
            (handoff,) = full["handoffs"]
            assert full["budget"]["staged"] == WINDOW * PAGE_BYTES == full["budget"]["reserved"], full["budget"]
            assert run(cancel(P, handoff["handoff_id"]))["cancelled"]
            # P's "cancelled" frame cannot cross a frozen link: cut it, or D waits out its stall timeout
            proxy.set_faults()
            request.join(60)
            assert not request.is_alive(), "the decode did not end after its handoff was cancelled"
    finally:
        proxy.close()
    cluster.idle(p, PAIRS[p])

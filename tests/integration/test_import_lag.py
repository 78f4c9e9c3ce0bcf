"""A decoder keeps up with its pages and leaves the CPU alone while it waits for them.

- Staged: every page of a 1,536-token prompt is held back until the prefiller has sent it all (a
  proxy between them; an MLX prefiller sends them from its prefix cache), so the whole stream
  lands at once; the time from the last page's arrival on the decoder's agent to the first token
  the decoder computes stays within a few of its own decode steps, and the engine has every page in its cache at no less than a rate measured for it
  (its own acknowledgement, engine_adapters/bridge.py).
- Trickled: the pages come as the prefiller computes them; between the first page and the last,
  the decoder's agent and engine processes use a small part of one core. (vLLM's engine core and
  SGLang's scheduler each spun a whole core while a request waited for pages, which slowed a
  torch prefiller beside them 1.8-4.5x: engine_adapters/vllm_plugin.py, sglang_backend.py.)"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from contextlib import contextmanager

import numpy as np
import psutil
import pytest

from tandem_protocol.client import AgentClient

from ..agents import TEST_KEY, TamperProxy, wait_for
from ..conftest import write_report

TOKENS = 1536  # 24 pages (23 and a bit where the decoder recomputes the last token)
# decoder agent -> a prefiller of another engine (torch's and MLX's CPU prefills are the quickest
# here: 3-4x vLLM's and SGLang's). What is measured is the decoder's: the staged pages are released
# at once whoever computed them, and the trickle only needs to last (was vLLM for the torch decoder).
PREFILLERS = {"torch": "mlx", "mlx": "torch", "vllm": "torch", "sglang2": "torch"}
# Prefillers that send the staged prompt from their prefix cache: MLX's prefill of 1,536 tokens took
# ~20 s in a loaded run (torch's ~4 s), most of the test. It learns the prompt first as the decoder
# of a request its decoder prefills (its prefix cache on for the test), so the staged pages leave
# at once without being computed: what is measured is the decoder's.
FROM_CACHE = {"mlx"}
# The trickle's prompt where MLX prefills it: after the first chunk's pages, 512 tokens still to
# compute before the last (~3 s alone, ~7 s loaded; the test needs > 1 s). Was 1,536: pages over
# ~20 s, for a figure that is a rate (cores).
TRICKLE_TOKENS = {"mlx": 768}
# Decoders whose first decode from imported pages is slower than the rest (a cold start this test
# does not measure): a fresh vLLM took 3-9 of its steps longer. They decode another prompt first.
COLD_FIRST = {"vllm", "sglang2"}
# The most decode steps the last page's arrival may precede the first computed token by: twice
# the most measured (3.6: torch -> vLLM and torch -> SGLang, torch -> MLX 3.5, vLLM -> torch 3.1;
# the medians 1.7-2.6). Pages released through the proxy at 0.7-1.2 GB/s.
MAX_STEPS = 7.2
# The least rate (bytes/s) at which each decoder may take in the staged pages, from the first
# page's arrival to the engine's "every page imported": a third of the least measured on a loaded
# machine (torch 0.61-1.05 GB/s, vLLM 0.355-0.66, SGLang 0.27-0.63; MLX 0.60-0.81 since it imports
# into its own buffers, 0.09-0.16 before, when it copied the whole cache after the last page). Was
# half (0.30, 0.19, 0.13, 0.35 GB/s): vLLM measured 0.355 beside other suites, 1.9x its floor.
# Below the 1 GB/s goal of issue 18 for every engine but torch: a CPU engine widens each FP16 page
# to float32 as it imports it, about 1 GB/s on one core here.
MIN_IMPORT_RATE = {"torch": 0.20e9, "vllm": 0.12e9, "sglang": 0.09e9, "mlx": 0.20e9}
# The most CPU (cores) the decoder's processes may use while its pages trickle in: twice the most
# measured (vLLM 0.16, MLX 0.09, SGLang 0.07, torch 0.00; before the fix vLLM used 1.23, SGLang 0.57).
MAX_WAITING_CORES = 0.32


@contextmanager
def prefix_cache(agent, model: str, nbytes: int):
    """The agent's prefix cache at `nbytes` while the block runs, off again after (the cluster's
    agents keep none: tests/agents.py)."""

    def set_to(n: int) -> None:
        with agent.client() as c:
            r = c.post("/v1/config", json={"engine": agent.engine, "model_path": model, "prefix_cache_bytes": n})
            assert r.status_code == 200 and not r.json().get("loading"), r.text

    set_to(nbytes)
    try:
        yield
    finally:
        set_to(0)


async def timed_decode(d_url: str, body: dict) -> list[tuple[float, dict]]:
    """D's NDJSON lines, each with the wall-clock time it arrived."""
    client = AgentClient(d_url, TEST_KEY)
    try:
        return [(time.time(), line) async for line in client.lines("/v1/decode", body)]
    finally:
        await client.aclose()


@pytest.mark.parametrize("decoder", list(PREFILLERS))
def test_staged_pages_are_imported_within_a_few_decode_steps(cluster, smol_dir, long_ids, decoder):
    p = cluster[PREFILLERS[decoder]]
    if p.engine in FROM_CACHE:
        with prefix_cache(p, str(smol_dir), 64 << 20):
            staged_pages_are_imported(cluster, long_ids, decoder, learn=True)
    else:
        staged_pages_are_imported(cluster, long_ids, decoder)


def staged_pages_are_imported(cluster, long_ids, decoder: str, learn: bool = False) -> None:
    p, d = cluster[PREFILLERS[decoder]], cluster[decoder]
    ids = (list(long_ids) * 8)[:TOKENS]
    if learn:  # P decodes the prompt, D prefilling it (D keeps no prefix cache): P's cache holds it
        body = {"token_ids": ids, "sampling": {"max_tokens": 1}, "prefill_url": d.url}
        assert asyncio.run(timed_decode(p.url, body))[-1][1].get("done")
    if decoder in COLD_FIRST:  # a P/D decode of another prompt of the same length first
        warm = {"token_ids": (list(long_ids) * 8)[7 : TOKENS + 7], "sampling": {"max_tokens": 2}, "prefill_url": p.url}
        assert asyncio.run(timed_decode(d.url, warm))[-1][1].get("done")
    proxy = TamperProxy(p.port)
    proxy.hold_pages()
    sent = p.status()["totals"]["pages_sent"]
    body = {"token_ids": ids, "sampling": {"max_tokens": 16, "ignore_eos": True}, "prefill_url": proxy.url}

    async def staged_then_released() -> list[tuple[float, dict]]:
        request = asyncio.create_task(timed_decode(d.url, body))

        def all_sent() -> bool:
            s = p.status()
            return s["open_handoffs"] == 0 and s["totals"]["pages_sent"] >= sent + TOKENS // 64 - 1

        await asyncio.to_thread(wait_for, all_sent, 120)
        proxy.release_pages()
        return await request

    try:
        timed = asyncio.run(staged_then_released())
    finally:
        proxy.close()
    done = timed[-1][1]
    assert done.get("done"), done
    arrivals = [t for t, line in timed if "token" in line]
    step = statistics.median(b - a for a, b in zip(arrivals[1:], arrivals[2:]))  # D's own steps
    # the first token D computes: a commit-first decoder's first is the prefiller's
    computed = arrivals[1] if d.status()["decoder_modes"][0] == "commit-first" else done["first_token_at"]
    lag = computed - done["last_page_at"]
    burst = done["last_page_at"] - done["first_page_at"]
    imported = done["last_page_imported_at"]  # the engine's own word: every page in its cache
    figures = {
        "decoder": d.engine,
        "prefiller": p.engine,
        "pages": done["pages"],
        "wire_bytes": done["wire_bytes"],
        "burst_seconds": burst,
        "arrival_rate_bytes_per_second": done["wire_bytes"] / burst,
        "last_page_to_imported_seconds": imported - done["last_page_at"],
        "imported_to_first_computed_token_seconds": computed - imported,
        "last_page_to_first_token_seconds": lag,
        "decode_step_seconds": step,
        "lag_in_steps": lag / step,
        "import_rate_bytes_per_second": done["wire_bytes"] / (imported - done["first_page_at"]),
    }
    write_report(f"import_lag_{d.engine}", figures)
    print(
        f"\n{p.engine}->{d.engine}: {done['pages']} staged pages in {burst * 1000:.0f} ms "
        f"({figures['arrival_rate_bytes_per_second'] / 1e9:.2f} GB/s), all imported "
        f"{figures['last_page_to_imported_seconds'] * 1000:.0f} ms after the last arrived: import "
        f"{figures['import_rate_bytes_per_second'] / 1e9:.2f} GB/s; first token computed "
        f"{(computed - imported) * 1000:.0f} ms later; last page to first token {lag * 1000:.0f} ms = "
        f"{lag / step:.1f} decode steps of {step * 1000:.0f} ms"
    )
    assert done["pages"] >= TOKENS // 64 - 1, done
    assert lag <= MAX_STEPS * step, figures
    assert figures["import_rate_bytes_per_second"] >= MIN_IMPORT_RATE[d.engine], figures
    cluster.idle(p, d)


def process_tree_cpu(pid: int) -> float:
    """CPU seconds used so far by a process and its children (an agent and its engine server)."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


@pytest.mark.parametrize("decoder", list(PREFILLERS))
def test_a_decoder_waiting_for_its_pages_leaves_the_cpu_alone(cluster, long_ids, decoder):
    p, d = cluster[PREFILLERS[decoder]], cluster[decoder]
    # not the staged test's prompt, and P's cache is off again: every page computed as it goes
    ids = (list(long_ids) * 8)[::-1][: TRICKLE_TOKENS.get(p.engine, TOKENS)]
    body = {"token_ids": ids, "sampling": {"max_tokens": 4, "ignore_eos": True}, "prefill_url": p.url}
    samples, stop = [], threading.Event()

    def sample() -> None:  # (time, CPU seconds) of D's processes, every 20 ms
        while not stop.wait(0.02):
            samples.append((time.time(), process_tree_cpu(d.proc.pid)))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        done = asyncio.run(timed_decode(d.url, body))[-1][1]
    finally:
        stop.set()
        sampler.join()
    assert done.get("done"), done
    times, cpu = np.array(samples).T
    first, last = done["first_page_at"], done["last_page_at"]
    used = np.interp(last, times, cpu) - np.interp(first, times, cpu)
    cores = used / (last - first)
    write_report(f"waiting_cpu_{d.engine}", {"pages_seconds": last - first, "cpu_seconds": used, "cores": cores})
    print(
        f"\n{p.engine}->{d.engine}: pages over {last - first:.2f} s, the decoder's processes used "
        f"{used:.2f} CPU s meanwhile ({cores:.2f} cores)"
    )
    assert last - first > 1, done  # the pages did trickle: the prefill took a while
    assert cores <= MAX_WAITING_CORES, (cores, done)
    cluster.idle(p, d)

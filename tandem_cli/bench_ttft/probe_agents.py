"""Requests the benchmark sends its agents and panel directly: a timed completion, an engine's
decode step, P's counters, and one traced P/D request."""

from __future__ import annotations

import json
import ssl
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
import numpy as np

if TYPE_CHECKING:
    from .cluster import Agent


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    """n random token ids; the seed makes every prompt's start distinct (no prefix reuse)."""
    return [int(x) for x in np.random.default_rng(seed).integers(100, vocab - 100, size=n)]


def ttft(http: httpx.Client, model: str, ids: list[int], max_tokens: int) -> float:
    """Seconds from sending a streaming completion to its first chunk with a choice."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"choices"' in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{model}: the stream carried no token")
    return first


@dataclass(frozen=True)
class PrefillerCounters:
    """An agent's handoff counters (its /metrics): read before and after one request, their
    differences are that request's own prefill time (P's clock) and the page bytes it sent."""

    prefills: float
    prefill_seconds: float
    pages_sent: float
    bytes_sent: float


_COUNTERS = {
    "tandem_handoff_prefill_seconds_count": "prefills",
    "tandem_handoff_prefill_seconds_sum": "prefill_seconds",
    "tandem_pages_sent_total": "pages_sent",
    "tandem_page_bytes_sent_total": "bytes_sent",
}


def prefiller_counters(agent: Agent, key: str) -> PrefillerCounters:
    headers = {"Authorization": f"Bearer {key}"}
    text = httpx.get(agent.url + "/metrics", headers=headers, timeout=30, verify=agent.verify()).text
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in _COUNTERS:
            found[_COUNTERS[name]] = float(value)
    missing = set(_COUNTERS.values()) - set(found)
    if missing:
        raise RuntimeError(f"{agent.url}/metrics lacks {', '.join(sorted(missing))}")
    return PrefillerCounters(**found)


def decode_step_seconds(agent: Agent, key: str, vocab: int) -> dict:
    """One decode step of the agent's engine: the gaps between its streamed tokens (three short
    requests, the first gap of each skipped), fastest and median."""
    gaps = []
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=600, verify=agent.verify()) as c:
        for seed in range(3):
            body = {
                "token_ids": prompt_ids(32, 10_000 + seed, vocab),
                "sampling": {"max_tokens": 12, "ignore_eos": True},
            }
            stamps = []
            with c.stream("POST", agent.url + "/v1/generate", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith('{"token"'):
                        stamps.append(time.perf_counter())
            gaps += [b - a for a, b in zip(stamps[1:], stamps[2:])]  # skip the prefill
    return {"min": min(gaps), "median": statistics.median(gaps)}


def trace_pd(p: Agent, d: Agent, key: str, ids: list[int], max_tokens: int, encoding: str = "raw") -> dict:
    """One P/D request sent the way the panel's router sends it (one POST /v1/decode to D, which
    creates the handoff on P), with the agents' own timestamps (same host, one clock): where each
    millisecond of it goes."""
    headers = {"Authorization": f"Bearer {key}"}
    sampling = {"max_tokens": max_tokens, "temperature": 0}
    body = {"token_ids": ids, "sampling": sampling, "prefill_url": p.url, "page_encoding": encoding}
    body |= {"prefill_fingerprint": p.tls_fingerprint} if p.tls_fingerprint else {}  # D pins P, as the panel asks
    with httpx.Client(headers=headers, timeout=600, verify=d.verify()) as c:
        t0 = time.time()
        stamps, done, last = [], None, ""
        with c.stream("POST", d.url + "/v1/decode", json=body) as r:
            for line in r.iter_lines():
                last = line or last
                if line.startswith('{"token"'):
                    stamps.append(time.time())
                elif line.startswith('{"done"'):
                    done = json.loads(line)
    if done is None or not stamps or done.get("prefill_finished_at") is None:
        return {"error": last[:500] or f"HTTP {r.status_code}"}  # reported in the output, the run goes on
    first = stamps[0]
    prefill_start = done["prefill_finished_at"] - done["prefill_seconds"]
    parts = {
        "D: checks + handoff on P, to prefill start": prefill_start - t0,
        "P: prefill": done["prefill_seconds"],
        "wire: last page after prefill end": done["last_page_at"] - done["prefill_finished_at"],
        "D: first token after last page": first - done["last_page_at"],
    }
    return {
        "total_seconds": first - t0,
        "parts": parts,
        "decoder": decoder_stages(done, stamps, d.info["decoder_modes"][0]),
        "pages": done["pages"],
        "wire_bytes": done["wire_bytes"],
        "first_page_before_prefill_end_seconds": done["prefill_finished_at"] - done["first_page_at"],
        "cached_tokens_on_p": done.get("prefill_cached_tokens", 0),
        "stamps": {k: done.get(k) for k in ("first_page_at", "last_page_at", "last_page_imported_at")},
    }


def set_prefix_cache(url: str, headers: dict, status: dict, nbytes: int, verify: ssl.SSLContext | bool = True) -> None:
    """The agent's prefix cache budget (POST /v1/config with the engine and model of its `status`)."""
    body = {"engine": status["engine"], "model_path": status["model_path"], "prefix_cache_bytes": nbytes}
    httpx.post(url + "/v1/config", json=body, headers=headers, timeout=120, verify=verify).raise_for_status()


def trace_held_on_p(
    p: Agent, d: Agent, key: str, ids: list[int], max_tokens: int, encoding: str = "raw"
) -> dict | None:
    """The decoder's import rate with every page ready on P before D asks: P computes the prompt
    alone first (its prefix cache keeps the pages), then one traced P/D request, in which P
    computes only the last token and sends the held pages at once, so they arrive as fast as
    the link carries them. Import rate = wire bytes ÷ (first page in on D -> every page in D's
    engine cache, the engine's own word); arrival rate = wire bytes ÷ (first page -> last).
    None where P keeps no prefix cache of Tandem's (SGLang), or one that takes a restart to turn
    on (vLLM's)."""
    headers = {"Authorization": f"Bearer {key}"}
    status = httpx.get(p.url + "/v1/status", headers=headers, timeout=30, verify=p.verify()).json()
    if status.get("prefix_cache") is None or status["engine"] == "vllm":
        return None
    body = {"token_ids": ids, "sampling": {"max_tokens": 1, "temperature": 0}}
    # the benchmark's agents run with their caches off (cold TTFT); P's is on for this probe only
    set_prefix_cache(p.url, headers, status, 1 << 30, p.verify())
    try:
        httpx.post(p.url + "/v1/generate", json=body, headers=headers, timeout=600, verify=p.verify()).read()
        t = trace_pd(p, d, key, ids, max_tokens, encoding)
    finally:
        set_prefix_cache(p.url, headers, status, status["prefix_cache"]["capacity"], p.verify())
    st = t.get("stamps") or {}
    if "error" in t or st.get("last_page_imported_at") is None:
        return {"error": t.get("error", "the decoder reported no import time")}
    burst = st["last_page_at"] - st["first_page_at"]
    importing = st["last_page_imported_at"] - st["first_page_at"]
    return {
        "prompt_tokens": len(ids),
        "pages": t["pages"],
        "wire_bytes": t["wire_bytes"],
        "cached_tokens_on_p": t["cached_tokens_on_p"],
        "arrival_bytes_per_second": t["wire_bytes"] / burst if burst > 0 else None,
        "import_bytes_per_second": t["wire_bytes"] / importing if importing > 0 else None,
        "last_page_to_imported_seconds": st["last_page_imported_at"] - st["last_page_at"],
        "ttft_seconds": t["total_seconds"],
    }


def decoder_stages(done: dict, stamps: list[float], mode: str) -> dict:
    """The decoder's own stages of one P/D request (one host, one clock): its pages in, every page
    in its engine's cache (the engine's own word, `last_page_imported_at`), then the first token
    it computes itself. A commit-first decoder streams the prefiller's token once the pages have
    arrived, maybe before they are all imported: its own first token is its second."""
    stages = {
        "first page to last page": done["last_page_at"] - done["first_page_at"],
        "last page to first token": done["first_token_at"] - done["last_page_at"],
    }
    imported = done.get("last_page_imported_at")
    computed = done["first_token_at"] if mode == "recompute-last" else (stamps[1] if len(stamps) > 1 else None)
    if imported is not None:
        stages["last page to imported"] = imported - done["last_page_at"]
        if computed is not None:
            stages["imported to first computed token"] = computed - imported
    return stages

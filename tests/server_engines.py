"""Checks shared by the tests of the engines that run as their own servers (vLLM, SGLang): the
pages they export against transformers' K/V, and the core issue's cross-engine rules with them as
prefiller (the decoder is torch or MLX, whose logits are visible)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil

from engine_adapters.base import EngineRequest
from tandem_protocol.handoff import FirstTokenMode, PrefillDone
from tandem_protocol.sampling import SamplingParams

from .agents import (
    TEST_KEY,
    AgentProcess,
    PanelProcess,
    TamperProxy,
    complete,
    log_rows,
    pages_of,
    pd_request,
    settle,
    tokens_of,
    wait_for,
    wait_until_streaming,
)
from .conftest import collect, own_greedy, prompt, run, write_report
from .load import BUDGET_PAGES, PAGE_BYTES, check_load
from .test_soak import run_soak


def check_pages_against_transformers(agent: AgentProcess, torch_engine, long_ids: list[int], report: str) -> None:
    """Page bytes from the server's cache against the K/V transformers computes for the same
    prompt (65 and 193 tokens): equal layout, values within a few FP16 ulps."""
    figures = {}
    for n in (65, 193):
        ids = prompt(long_ids, n)
        got = asyncio.run(pages_of(agent, ids))
        ref = [
            p
            for p in run(
                collect(
                    torch_engine.prefill(EngineRequest(f"ref{n}", ids, SamplingParams(), FirstTokenMode.COMMIT_FIRST))
                )
            )
            if not isinstance(p, PrefillDone)
        ]
        assert [(p.index, p.valid_tokens) for p in got] == [(p.index, p.valid_tokens) for p in ref]
        a = np.concatenate([p.kv for p in got], axis=2).astype(np.float32)
        b = np.concatenate([p.kv for p in ref], axis=2).astype(np.float32)
        diff = np.abs(a - b)
        scale = np.maximum(np.abs(b), 1.0)
        figures[n] = {
            "max_abs_diff": float(diff.max()),
            "max_rel_diff": float((diff / scale).max()),
            "mean_abs_diff": float(diff.mean()),
            "max_abs_value": float(np.abs(b).max()),
        }
        # FP16 compute in the server vs float32 compute rounded to FP16: a few FP16 ulps of the value
        assert (diff / scale).max() < 0.05, figures[n]
    write_report(report, figures)


@contextmanager
def engine_cluster(
    model: Path,
    home: Path,
    agents: dict[str, tuple[str, dict]],
    pairs: dict[str, tuple[str, str]],
    tampered: tuple[str, str] | None = None,
):
    """Agents (name -> (engine, environment)) started all at once — server engines take the better
    part of a minute — then each waited for, and a panel with `pairs` (name -> (P, D)). With
    `tampered` = (P, D), one more pair, "tampered", reaches P through a TamperProxy (pages can be
    damaged on the way). Yields {"panel", "client" (OpenAI), "proxy", name: AgentProcess ...}."""
    with ExitStack() as stack:
        started = {}
        for name, (engine, env) in agents.items():
            started[name] = AgentProcess(engine, model, home / name, "--stall-timeout", STALL_SECONDS, env=env)
            stack.callback(started[name].stop)  # stopped even if another one fails to start
        running = {name: a.__enter__() for name, a in started.items()}
        urls = {name: (running[p].url, running[d].url) for name, (p, d) in pairs.items()}
        proxy = None
        if tampered:
            proxy = TamperProxy(int(running[tampered[0]].url.rsplit(":", 1)[1]))
            stack.callback(proxy.close)
            urls["tampered"] = (proxy.url, running[tampered[1]].url)
        args = [a for name, (p, d) in urls.items() for a in ("--pair", f"{name}={p},{d}")]
        cluster = {"panel_home": home / "panel", "proxy": proxy, **running}
        start_panel(cluster, *args)
        stack.callback(lambda: cluster["panel"].stop())  # whichever panel runs by then (see restart)
        yield cluster


def start_panel(cluster: dict, *args: str) -> None:
    """A panel on the cluster's panel home (its pairs are kept there), and an OpenAI client for it."""
    panel = PanelProcess(cluster["panel_home"], *args)
    api_key = panel.api_key or cluster["client"].api_key  # a panel prints a new key only once
    cluster["panel"] = panel
    cluster["client"] = openai.OpenAI(base_url=panel.url + "/v1", api_key=api_key, max_retries=0, timeout=300)


STALL_SECONDS = "15"  # a page stream silent this long is broken (the agents' --stall-timeout)
LENGTHS = [64, 65, 66, 128, 129, 130, 193]  # the core issue's prompt lengths, around page boundaries
STREAMED = (64, 193)  # lengths also asked for streaming
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def ask_in_thread(client, pair: str, ids: list[int], result: dict) -> threading.Thread:
    """complete() on `pair` in a started thread; its text, or the exception the client saw, lands
    in `result` ("text" / "error")."""

    def go() -> None:
        try:
            result["text"] = complete(client, pair, ids, False)
        except Exception as e:  # what the client saw is what the test checks
            result["error"] = e

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def check_every_direction(
    cluster: dict, pairs: dict[str, tuple[str, str]], same_engine_pair: str, long_ids: list[int], report: str
) -> dict:
    """Every pair through the panel's OpenAI API: completions at each length, greedy agreement
    with the decoder alone (the decoder's node through the panel), the same-engine pair exactly
    equal to it, streaming equal to not streaming (at one length on each side of a page boundary:
    the stream is the same tokens framed differently, so every length would only repeat it); then
    chat, streaming and not, answering "Paris"."""
    client, figures = cluster["client"], {}
    decoders = sorted({d for _, d in pairs.values()})
    local = {
        d: {n: complete(client, f"node/{cluster[d].engine}-{d}", prompt(long_ids, n), False) for n in LENGTHS}
        for d in decoders
    }
    for pair, (p, d) in pairs.items():
        agree = 0
        for n in LENGTHS:
            ids = prompt(long_ids, n)
            whole = complete(client, pair, ids, False)
            if n in STREAMED:
                assert whole == complete(client, pair, ids, True), (pair, n)
            agree += whole == local[d][n]
            if pair == same_engine_pair:  # same engine, equal thread counts: exactly its own output
                assert whole == local[d][n], (n, whole, local[d][n])
        figures[pair] = {"direction": f"{p}->{d}", "greedy_agreement_with_decoder_alone": f"{agree}/{len(LENGTHS)}"}
        assert agree >= len(LENGTHS) - 1, (pair, figures[pair])
    for pair in pairs:
        whole = client.chat.completions.create(model=pair, messages=QUESTION, max_tokens=20, temperature=0)
        chunks = client.chat.completions.create(
            model=pair, messages=QUESTION, max_tokens=20, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert "Paris" in text, (pair, text)
        figures[pair]["chat"] = text
    write_report(report, figures)
    settle(*(cluster[name] for name in {n for pq in pairs.values() for n in pq}))
    return figures


def check_prefiller_rules(prefiller: AgentProcess, decoder: AgentProcess, decoder_engine, label: str) -> None:
    """The core issue's rules with a server engine as prefiller, over its 20 chat prompts: the
    decoder's first-step logits after importing the prefiller's pages against its own, and
    greedy agreement of P/D with the decoder alone."""
    from .test_cross_engine import LOGIT_TOLERANCE, MIN_AGREEMENT, PROMPTS, logits_after_import

    d = decoder_engine
    sampling = {"max_tokens": 32, "ignore_eos": True}
    diffs, agree = [], 0
    for text in PROMPTS:
        ids = d.chat_token_ids([{"role": "user", "content": text}])
        pages = asyncio.run(pages_of(prefiller, ids, "recompute-last"))
        imported, local = run(logits_after_import(d, pages, ids))
        diffs.append(float(np.abs(imported - local).max()))
        pd = tokens_of(asyncio.run(pd_request(prefiller.url, decoder.url, ids, sampling)))
        own = own_greedy(d, ids, sampling["max_tokens"])
        agree += pd == own
    figures = {
        "direction": label,
        "prompts": len(PROMPTS),
        "greedy_agreement": agree,
        "logit_max_abs_diff_max": max(diffs),
        "logit_max_abs_diff_median": float(np.median(diffs)),
        "logit_tolerance": LOGIT_TOLERANCE,
    }
    write_report("cross_engine_" + label.replace("->", "_to_"), figures)
    assert max(diffs) <= LOGIT_TOLERANCE, figures
    assert agree >= MIN_AGREEMENT, figures


def check_engine_crash_through_panel(
    cluster: dict, pair: str, prefiller: str, decoder: str, ready_stat: str, ids: list[int]
) -> None:
    """The prefiller's engine server SIGKILLed while a request of `pair` is prefilling on it,
    through the panel: the client still gets the decoder-alone answer (the router's fallback),
    the request log says why, and the agent restarts its engine."""
    client = cluster["client"]
    expected = complete(client, f"node/{cluster[decoder].engine}-{decoder}", ids, False)
    result: dict = {}
    thread = ask_in_thread(client, pair, ids, result)
    deadline = time.monotonic() + 120
    while not cluster[prefiller].status()["handoffs"]:  # the room exists: prefill has started
        assert time.monotonic() < deadline and thread.is_alive(), result
        time.sleep(0.02)
    kill_engine_and_wait_for_restart(cluster[prefiller], ready_stat)
    thread.join(300)
    assert result.get("text") == expected, result
    row = log_rows(cluster["panel_home"])[-1]
    assert row.route == "decode_alone" and "transfer failed before the first token" in row.reason, row
    settle(cluster[prefiller], cluster[decoder])


def check_damaged_streams_through_panel(
    cluster: dict, prefiller: str, decoder: str, ids: list[int], engine_idle: dict
) -> dict:
    """The "tampered" pair (engine_cluster's `tampered`) through the panel with a bit flipped in
    the first page, with the page stream cut short, and with the link going silent mid-stream
    (a pulled cable: the decoder's stall timeout ends it): each time the client gets the
    decoder-alone answer (the router's fallback; nothing damaged is decoded), the request log
    names the reason, both agents let go of everything and each engine's own KV pool is back
    to idle (`engine_idle`: agent name -> engine stat -> its idle value)."""
    client, proxy = cluster["client"], cluster["proxy"]
    expected = complete(client, f"node/{cluster[decoder].engine}-{decoder}", ids, False)
    seen = {}
    for damage, reason in (
        (dict(flip_at=300_000), "checksum mismatch on page 0"),
        (dict(cut_at=700_000), "broke off"),
        (dict(freeze_at=700_000), "stalled"),
    ):
        for name, value in damage.items():
            setattr(proxy, name, value)
        try:
            text = complete(client, "tampered", ids, False)
        finally:
            proxy.flip_at = proxy.cut_at = proxy.freeze_at = None
        assert text == expected, (damage, text, expected)
        row = log_rows(cluster["panel_home"])[-1]
        assert row.route == "decode_alone" and reason in row.reason, row
        seen[reason] = row.reason
        at_engine_baseline(cluster, (prefiller, decoder), engine_idle)
    return seen


def at_engine_baseline(cluster: dict, agents: tuple[str, ...], engine_idle: dict) -> None:
    """The agents idle (nothing reserved, no handoff, no request) and each engine's own KV pool
    back to its idle value (`engine_idle`: agent name -> engine stat -> value)."""
    settle(*(cluster[name] for name in agents), timeout=30)
    deadline = time.monotonic() + 30  # an engine frees its pool on its own schedule
    for name, stats in engine_idle.items():
        while not all((now := cluster[name].status()["engine_stats"])[k] == v for k, v in stats.items()):
            assert time.monotonic() < deadline, (name, now)
            time.sleep(0.2)


def check_slow_link_through_panel(
    cluster: dict, prefiller: str, decoder: str, ids: list[int], engine_idle: dict, rate: float = 4e6
) -> dict:
    """The "tampered" pair through a link held to `rate` bytes/s: the request completes P->D and
    neither agent's memory grows with the backed-up stream (the prefiller holds what it reserved,
    the decoder a few pages). A first request of the same length, at full speed, warms both up."""
    client, proxy = cluster["client"], cluster["proxy"]
    complete(client, "tampered", ids[::-1], False)
    agents = {name: psutil.Process(cluster[name].proc.pid) for name in (prefiller, decoder)}
    base = {name: p.memory_info().rss for name, p in agents.items()}
    peak, result = dict(base), {}
    proxy.rate = rate
    try:
        thread = ask_in_thread(client, "tampered", ids, result)
        while thread.is_alive():
            for name, p in agents.items():
                peak[name] = max(peak[name], p.memory_info().rss)
            time.sleep(0.02)
    finally:
        proxy.rate = None
    assert "text" in result, result
    row = log_rows(cluster["panel_home"])[-1]
    pages = -(-len(ids) // 64)
    assert row.route == "pd" and row.bytes_moved >= (pages - 1) * 1_474_560, row
    kv = len(ids) * 23_040
    grew = {name: (peak[name] - base[name]) / kv for name in agents}
    assert grew[prefiller] < 4 and grew[decoder] < 3, {n: f"{g:.2f}x the prompt's KV" for n, g in grew.items()}
    at_engine_baseline(cluster, (prefiller, decoder), engine_idle)
    return {"pages": pages, "rate_bytes_per_second": rate, "rss_growth_x_kv": {n: round(g, 2) for n, g in grew.items()}}


def check_panel_restart(
    cluster: dict, pair: str, prefiller: str, decoder: str, ids: list[int], engine_idle: dict
) -> dict:
    """The panel killed while a request of `pair` streams: the client's stream breaks, both
    agents and engines let go, the next panel logs the request as interrupted and serves."""
    client = cluster["client"]
    result: dict = {"chunks": 0}

    def ask() -> None:
        try:
            for _chunk in client.completions.create(model=pair, prompt=ids, max_tokens=400, temperature=0, stream=True):
                result["chunks"] += 1
        except Exception as e:  # what the client saw is what the test checks
            result["error"] = e

    thread = threading.Thread(target=ask)
    thread.start()
    deadline = time.monotonic() + 120
    while result["chunks"] < 3:
        assert time.monotonic() < deadline and thread.is_alive(), result
        time.sleep(0.02)
    while not (running := [r.id for r in log_rows(cluster["panel_home"]) if r.outcome == "running"]):
        assert time.monotonic() < deadline, "the streaming request was never logged as running"
        time.sleep(0.02)
    cluster["panel"].proc.kill()
    thread.join(60)
    assert isinstance(result.get("error"), (openai.APIConnectionError, httpx.TransportError)), result
    at_engine_baseline(cluster, (prefiller, decoder), engine_idle)
    start_panel(cluster)
    row = {r.id: r for r in log_rows(cluster["panel_home"])}[running[-1]]
    assert row.outcome == "interrupted" and "panel stopped" in row.error, row
    assert complete(cluster["client"], pair, ids[:64], False), "the restarted panel does not serve"
    at_engine_baseline(cluster, (prefiller, decoder), engine_idle)
    return {"chunks_before_kill": result["chunks"], "logged": row.error}


def kill_engine_and_wait_for_restart(agent: AgentProcess, ready_stat: str, timeout: float = 300) -> dict:
    """SIGKILL the agent's engine server; wait until the agent has started it again and it
    reports `ready_stat`. Returns the engine stats then."""
    stats = agent.status()["engine_stats"]
    os.kill(stats["pid"], 9)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = agent.status()["engine_stats"]
        if stats["restarts"] == 1 and stats[ready_stat] is not None:
            break
        time.sleep(0.5)
    assert stats["restarts"] == 1 and stats["pid"] is not None, stats
    return stats


def check_load_through_panel(
    cluster: dict, pair: str, prefiller: str, decoder: str, model: Path, engine_idle: dict
) -> dict:
    """tests/load.py on `pair`, with the prefiller's staging budget cut to a few prompts for the
    run (POST /v1/config: the same engine and model, so nothing reloads) and restored after. The
    server engines batch concurrent requests with batch-variant kernels (see check_load)."""
    p, d = cluster[prefiller], cluster[decoder]

    def budget(nbytes: int) -> None:
        with p.client() as c:
            r = c.post("/v1/config", json={"engine": p.engine, "model_path": str(model), "staging_bytes": nbytes})
            assert r.status_code == 200 and not r.json().get("loading"), r.text

    original = p.status()["budget"]["capacity"]
    budget(BUDGET_PAGES * PAGE_BYTES)
    try:
        figures = check_load(
            p, d, cluster["panel"].url, cluster["client"].api_key, pair, cluster["panel_home"], batch_invariant=False
        )
    finally:
        budget(original)
    at_engine_baseline(cluster, (prefiller, decoder), engine_idle)
    return figures


def check_soak_through_panel(
    cluster: dict, pairs: list[str], agents: tuple[str, ...], engine_idle: dict, seconds: float = 20
) -> dict:
    """bench/soak.py in its short form against this cluster's panel (`--panel`), on `pairs`:
    mixed, cancelled and disconnected requests, then every agent idle, no request-log row left
    running, each agent's RSS and its engine server's grown < 10%, and each engine's own pool
    back to idle."""
    args = [
        "--panel",
        cluster["panel"].url,
        "--api-key",
        cluster["client"].api_key,
        "--cluster-key",
        TEST_KEY,
        "--panel-db",
        str(cluster["panel_home"] / "panel" / "panel.db"),
        "--duration",
        str(seconds),
    ]
    args += [a for name in agents for a in ("--agent", cluster[name].url)]
    args += [a for pair in pairs for a in ("--model", pair)]
    result = run_soak(cluster["panel_home"].parent / "soak.json", *args)
    engines = {f"{cluster[name].status()['name']} engine" for name in engine_idle}
    assert engines <= set(result["rss"]), result["rss"]  # the engine servers' memory is watched too
    at_engine_baseline(cluster, agents, engine_idle)
    return {
        "requests": result["requests"],
        "total_requests": result["total_requests"],
        "rss_growth_percent": {n: m["growth_percent"] for n, m in result["rss"].items()},
    }


def check_peer_kills_through_panel(
    cluster: dict, decoder: str, prefiller: str, model: Path, home: Path, ids: list[int], engine_idle: dict
) -> dict:
    """Server-engine agents with a torch peer killed mid-stream, through a panel of their own: the
    peer as prefiller of `decoder`, killed once its first page is out (the client gets the
    decoder-alone answer, the router's fallback, logged), and as decoder of `prefiller`, killed once
    it has imported a page (a clear 503 naming it unreachable, logged); each time the surviving
    agent and its engine's pool let go (`engine_idle`)."""
    d, p = cluster[decoder], cluster[prefiller]
    with (
        AgentProcess("torch", model, home / "doomed-p") as dp,
        AgentProcess("torch", model, home / "doomed-d") as dd,
        PanelProcess(home / "kill-panel", "--pair", f"in={dp.url},{d.url}", "--pair", f"out={p.url},{dd.url}") as panel,
    ):
        client = openai.OpenAI(base_url=panel.url + "/v1", api_key=panel.api_key, max_retries=0, timeout=300)
        expected = complete(client, f"node/{d.engine}-{decoder}", ids, False)
        result: dict = {}
        thread = ask_in_thread(client, "in", ids, result)
        wait_until_streaming(dp)
        dp.proc.kill()
        thread.join(300)
        assert result.pop("text", None) == expected, result
        row = log_rows(home / "kill-panel")[-1]
        assert row.route == "decode_alone" and "transfer failed before the first token" in row.reason, row
        at_engine_baseline(cluster, (decoder,), {decoder: engine_idle[decoder]})
        fallback = row.reason

        before = dd.status()["totals"]["pages_received"]
        thread = ask_in_thread(client, "out", ids, result)
        wait_for(lambda: dd.status()["totals"]["pages_received"] > before, 120)
        dd.proc.kill()
        thread.join(300)
        error = result.get("error")
        assert (
            isinstance(error, openai.APIStatusError) and error.status_code == 503 and "not reachable" in str(error)
        ), result
        row = log_rows(home / "kill-panel")[-1]
        assert row.outcome == "error" and "not reachable" in row.error, row
        at_engine_baseline(cluster, (prefiller,), {prefiller: engine_idle[prefiller]})
    return {"prefiller_killed": fallback[:200], "decoder_killed": row.error[:200]}

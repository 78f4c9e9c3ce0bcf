"""The planner's estimates of time to first token from measured figures (planner.py,
node_figures.py): which route wins, what it predicts, and how figures are learned."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from control_panel.node_figures import MIN_LEARN_TOKENS, NodeFigures, length_bucket
from control_panel.planner import PD_OVERHEAD_SECONDS, Planner
from control_panel.prefix_index import hashes_of
from control_panel.router import CALIBRATION_TOKENS, Router, RouteStats, Target
from tandem_protocol.sampling import SamplingParams

P, D, D2 = "http://p.test:1", "http://d.test:1", "http://d2.test:1"
KV_PER_TOKEN = 23_040  # the embedded model's


def desk(p_spt=0.002, d_spt=0.010, bps=1e9, rtt=0.0002, step=0.05) -> Planner:
    """A fast prefiller (2 ms per token) and a slow-prefill decoder (10 ms), 1 GB/s between them."""
    f = NodeFigures()
    for url, spt in ((P, p_spt), (D, d_spt), (D2, d_spt)):
        f.prefilled(url, 2048, 2048, spt * 2048)
        f.stepped(url, 10, step * 10)
    for d in (D, D2):
        f.linked(P, d, bps, rtt, KV_PER_TOKEN * 64)
    return Planner(figures=f)


def test_a_long_fresh_prompt_goes_p_d_and_a_short_delta_stays_on_the_decoder():
    planner = desk()
    fresh = list(range(2000))
    plan = planner.plan((D,), (P,), hashes_of(fresh), len(fresh))
    assert plan.route == "pd" and plan.prefill_url == P
    # P's 2,000 tokens at 2 ms (the link's 46 MB at 1 GB/s is shorter), two round trips, the
    # overhead; a decoder that recomputes the last prompt token adds its step
    assert plan.predicted_seconds == pytest.approx(2000 * 0.002 + 2 * 0.0002 + PD_OVERHEAD_SECONDS)
    planner.figures.node(D).recompute_last = True
    recompute = planner.plan((D,), (P,), hashes_of(fresh), len(fresh))
    assert recompute.predicted_seconds == pytest.approx(plan.predicted_seconds + 0.05)
    assert "alone" in plan.reason and "est." in plan.reason
    # the next turn: D holds the history and its answer, P only the first prompt; 10 new tokens
    answer = list(range(5000, 5064))
    turn = fresh + answer + list(range(9000, 9010))
    planner.index.add(D, hashes_of(fresh + answer))
    planner.index.add(P, hashes_of(fresh))
    plan = planner.plan((D,), (P,), hashes_of(turn), len(turn))
    assert plan.route == "decode_alone" and plan.decode_url == D
    # D holds 2,048 of 2,074 tokens: 26 new at 10 ms = 0.26 s, over its step's floor
    assert plan.held_tokens == 2048 and plan.predicted_seconds == pytest.approx(26 * 0.010)


def test_a_slow_link_keeps_a_mid_length_prompt_on_the_decoder():
    fresh = list(range(1000))
    fast = desk(bps=1e9).plan((D,), (P,), hashes_of(fresh), len(fresh))
    slow = desk(bps=1e6).plan((D,), (P,), hashes_of(fresh), len(fresh))  # 23 MB at 1 MB/s: 23 s
    assert fast.route == "pd" and slow.route == "decode_alone"
    assert slow.predicted_seconds == pytest.approx(1000 * 0.010)


def test_a_busy_decoder_loses_a_fresh_prompt_to_an_idle_one():
    planner = desk()
    fresh = list(range(2000))
    first = planner.plan((D, D2), (P,), hashes_of(fresh), len(fresh))
    work = planner.started(first, len(fresh))  # queued on P and on its decoder
    second = planner.plan((D, D2), (P,), hashes_of(fresh[::-1]), len(fresh))
    assert {first.decode_url, second.decode_url} == {D, D2}
    # the second waits behind the first on P: its estimate counts P's queue
    assert second.predicted_seconds > first.predicted_seconds + 2000 * 0.002 * 0.9
    planner.ended(work)


def test_unmeasured_figures_or_a_threshold_keep_the_rule_in_tokens():
    fresh = list(range(2000))
    plan = Planner().plan((D,), (P,), hashes_of(fresh), len(fresh))
    assert plan.route == "pd" and plan.predicted_seconds is None
    assert "not every node and link is measured yet" in plan.reason
    # a threshold overrides the estimates: 2,000 new tokens are under 4,096
    plan = desk().plan((D,), (P,), hashes_of(fresh), len(fresh), local_threshold=4096)
    assert plan.route == "decode_alone" and plan.predicted_seconds is None and "threshold" in plan.reason


def test_figures_follow_their_observations():
    f = NodeFigures()
    assert f.seconds_per_token(P, 100) is None
    f.prefilled(P, 2000, MIN_LEARN_TOKENS - 1, 1.0)  # a short prefill is a forward's fixed cost
    assert f.seconds_per_token(P, 100) is None
    f.prefilled(P, 2000, 1000, 2.0)
    assert f.seconds_per_token(P, 2000) == f.seconds_per_token(P, 100) == 0.002  # the nearest length
    f.prefilled(P, 2000, 1000, 4.0)
    assert f.seconds_per_token(P, 2000) == pytest.approx(0.7 * 0.002 + 0.3 * 0.004)
    f.prefilled(P, 200, 200, 0.2)
    assert f.seconds_per_token(P, 150) == 0.001 and length_bucket(150) == length_bucket(200)
    f.linked(P, D, 5e8, 0.001, 1_474_560)
    assert not f.link_stale(P, D) and f.kv_bytes_per_token == 23_040
    f.forget(P)
    assert f.seconds_per_token(P, 2000) is None and f.link(P, D) is None


def test_the_router_learns_rates_from_answers_and_measures_what_it_lacks():
    """After a request the router feeds the figures from D's last line (P's prefill seconds on
    P/D, D's own TTFT alone), then calibrates the nodes it has no figure for and probes the link."""
    calls = []

    def agent(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/info":
            return httpx.Response(200, json={"decoder_modes": ["recompute-last"]})
        body = json.loads(request.content)
        calls.append((request.url.host, request.url.path, body))
        if request.url.path == "/v1/bench/link":
            return httpx.Response(
                200, json={"bytes_per_second": 8e8, "rtt_seconds": 0.0003, "page_bytes": KV_PER_TOKEN * 64}
            )
        n = len(body["token_ids"])
        done = {"done": True, "finish_reason": "length", "ttft_seconds": n * 0.01, "cached_tokens": 0}
        if "prefill_url" in body:
            done |= {"prefill_seconds": n * 0.002, "prefill_cached_tokens": 0}
        lines = [{"token": 7, "text": "x"}] * 4 + [done]
        return httpx.Response(200, content="".join(json.dumps(x) + "\n" for x in lines).encode())

    router = Router("key", httpx.MockTransport(agent))
    target = Target("m", (D,), (P,))

    async def main():
        stats = RouteStats()
        async for _ in router.run(target, list(range(1000)), SamplingParams(max_tokens=4), stats):
            pass
        await asyncio.gather(*router._measuring.values())
        await router.aclose()
        return stats

    stats = asyncio.run(main())
    f = router.planner.figures
    assert stats.route == "pd" and stats.predicted_ttft_ms is None  # nothing was measured before it
    assert f.seconds_per_token(P, 1000) == pytest.approx(0.002)  # from P's prefill seconds
    assert f.seconds_per_token(D, 1000) == pytest.approx(0.01)  # from the calibration's TTFT
    assert f.link(P, D).bytes_per_second == 8e8 and f.kv_bytes_per_token == KV_PER_TOKEN
    assert f.node(D).recompute_last is True  # from D's /v1/info
    calibrated = {host for host, path, body in calls if path == "/v1/generate"}
    assert calibrated == {"d.test"}  # P's figure came from the request; D had none
    assert [len(b["token_ids"]) for _, path, b in calls if path == "/v1/generate"] == [CALIBRATION_TOKENS]
    assert [(h, b["peer"]) for h, path, b in calls if path == "/v1/bench/link"] == [("d.test", P)]
    assert not router.planner.busy()

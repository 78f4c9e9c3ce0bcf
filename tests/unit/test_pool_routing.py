"""A pool's routing: which decoder and prefiller the planner picks, and what happens when one
fails before the first token. Fake agents behind an httpx transport (one per host); the real
three-node pool is tests/system/test_pools.py's."""

from __future__ import annotations

import asyncio
import json

import httpx

from control_panel.planner import RUNNING_TOKENS, Planner
from control_panel.prefix_index import PrefixIndex, hashes_of
from control_panel.router import RouteError, Router, RouteStats, Target
from tandem_protocol.api import PREFILLER_FAILED
from tandem_protocol.sampling import SamplingParams

P1, P2 = "http://p1.test:1", "http://p2.test:1"
D1, D2 = "http://d1.test:1", "http://d2.test:1"
ANSWER = [101, 102, 103, 104]


def ndjson(lines: list[dict]) -> httpx.Response:
    return httpx.Response(200, content="".join(json.dumps(x) + "\n" for x in lines).encode())


def answer(body: dict) -> httpx.Response:
    return ndjson([*({"token": t, "text": "x"} for t in ANSWER), {"done": True, "finish_reason": "length"}])


class Agents:
    """Every node of a pool: `broken` maps a host to how it fails (an exception or a response)."""

    def __init__(self):
        self.calls: list[tuple[str, str, dict]] = []  # (host, path, body)
        self.broken: dict[str, object] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, body = request.url.host, json.loads(request.content)
        self.calls.append((host, request.url.path, body))
        failure = self.broken.get(host)
        if isinstance(failure, Exception):
            raise failure
        if callable(failure):
            return failure(body)
        return answer(body)

    def served(self) -> list[tuple[str, str | None]]:
        """(decoder host, prefiller host or None) of each call."""
        return [(host, (b.get("prefill_url") or "").split("//")[-1].split(":")[0] or None) for host, _, b in self.calls]


def serve(
    router: Router, target: Target, prompts: list[list[int]], stats: RouteStats | None = None
) -> list[list[dict]]:
    """Each prompt's events, one after the other; `stats`: where the (last) request's figures go."""

    async def one(ids):
        return [e async for e in router.run(target, ids, SamplingParams(max_tokens=4), stats or RouteStats())]

    async def main():
        try:
            return [await one(ids) for ids in prompts]
        finally:
            await router.aclose()

    return asyncio.run(main())


def conversation(seed: int, turns: int) -> list[list[int]]:
    """Each turn's prompt: the previous prompt, its answer, then a new user turn of 40 tokens."""
    prompts = [[seed * 1000 + i for i in range(300)]]
    for t in range(1, turns):
        prompts.append(prompts[-1] + ANSWER + [seed * 1000 + 500 + 40 * t + i for i in range(40)])
    return prompts


def pool(**extra) -> Target:
    return Target("m", (D1, D2), (P1, P2), **extra)


def test_fresh_conversations_spread_and_each_stays_on_its_decoder():
    agents = Agents()
    router = Router("key", httpx.MockTransport(agents))
    chats = [conversation(seed, 3) for seed in range(1, 5)]
    for turn in range(3):  # turn by turn, conversations interleaved
        serve(router, pool(), [c[turn] for c in chats])
    decoders = [host for host, _ in agents.served()]
    first = decoders[:4]
    assert sorted(first) == ["d1.test", "d1.test", "d2.test", "d2.test"]  # spread over both
    for k in range(4):  # every later turn on the decoder of its first
        assert decoders[4 + k] == decoders[8 + k] == first[k]


def test_a_conversation_leaves_its_decoder_only_when_that_one_is_far_busier():
    planner = Planner()
    prompt = list(range(2048 + 40))
    held = hashes_of(prompt)
    planner.index.add(D1, held[:32])  # D1 holds the history: 2,048 tokens
    assert planner.plan((D1, D2), (P1,), held, len(prompt)).decode_url == D1
    others = [planner.started(planner.plan((D1,), (P1,), [], 1000), 1000) for _ in range(2)]
    assert planner.load(D1) == 2000  # two fresh prompts of 1,000 tokens queued there: 40 + 2,000 < 2,088
    assert planner.plan((D1, D2), (P1,), held, len(prompt)).decode_url == D1
    planner.first_token(others[0])  # one answers: its queue share is a running row now
    assert planner.load(D1) == 1000 + RUNNING_TOKENS
    third = planner.started(planner.plan((D1,), (P1,), [], 1100), 1100)
    assert planner.plan((D1, D2), (P1,), held, len(prompt)).decode_url == D2  # 40 + 2,132 > 2,088
    for work in (*others, third):
        planner.ended(work)
    assert planner.load(D1) == 0 and not planner.pending and not planner.running


def test_a_short_new_part_past_what_the_decoder_holds_runs_on_it_alone():
    agents = Agents()
    router = Router("key", httpx.MockTransport(agents))
    first, second = conversation(7, 2)
    serve(router, pool(local_threshold=100), [first, second])
    assert agents.calls[0][1] == "/v1/decode"  # 300 fresh tokens: P/D
    assert agents.calls[1][1] == "/v1/generate" and agents.calls[1][0] == agents.calls[0][0]  # 44 new: D alone
    names = ((D1, "mac-1"), (D2, "mac-2"), (P1, "pc"), (P2, "pc-2"))
    stats = RouteStats()
    serve(router, pool(local_threshold=100, node_names=names), [second], stats)  # the log names nodes
    home = dict(names)[f"http://{agents.calls[0][0]}:1"]
    assert stats.route == "decode_alone" and stats.decode_node == home and stats.prefill_node == ""
    assert (
        stats.reason == f"{home} holds 320 of {len(second)} prompt tokens: {len(second) - 320} new, under the threshold"
    )


def test_a_decoder_that_cannot_be_reached_is_replaced_and_then_skipped():
    agents = Agents()
    router = Router("key", httpx.MockTransport(agents))
    chat = conversation(3, 3)
    serve(router, pool(), chat[:1])
    home = agents.calls[0][0]
    agents.broken[home] = httpx.ConnectError("connection refused")  # it died
    events = serve(router, pool(), chat[1:])
    assert [[e.get("token") for e in ev if "token" in e] for ev in events] == [ANSWER, ANSWER]
    other = "d2.test" if home == "d1.test" else "d1.test"
    assert [host for host, *_ in agents.calls[1:]] == [home, other, other]  # tried once, then skipped


def test_a_full_decoder_sends_the_request_to_another_and_all_full_is_429():
    agents = Agents()
    router = Router("key", httpx.MockTransport(agents))
    busy = httpx.Response(
        429, json={"error": {"message": "decode KV budget stayed busy"}}, headers={"Retry-After": "3"}
    )
    agents.broken["d1.test"] = lambda body: busy
    serve(router, pool(), [list(range(100))])
    assert [host for host, *_ in agents.calls] in (["d1.test", "d2.test"], ["d2.test"])
    agents.broken["d2.test"] = lambda body: busy
    try:
        serve(router, pool(), [list(range(200))])
    except RouteError as e:
        assert e.status == 429 and e.retry_after == 3.0
    else:
        raise AssertionError("both decoders are full: 429")


def test_a_failed_prefiller_is_replaced_by_the_other_before_the_decoder_goes_alone():
    agents = Agents()
    router = Router("key", httpx.MockTransport(agents))

    def p_failed(body):
        if body.get("prefill_url") == P1:
            return httpx.Response(502, json={"error": {"message": "prefiller unreachable", PREFILLER_FAILED: True}})
        return answer(body)

    agents.broken = {"d1.test": p_failed, "d2.test": p_failed}
    planner_first = router.planner.plan((D1, D2), (P1, P2), [], 100).prefill_url
    assert planner_first == P1  # the tie goes to the first listed
    router.planner = Planner()
    stats = RouteStats()
    serve(router, pool(), [list(range(100))], stats)
    assert [b.get("prefill_url") for *_, b in agents.calls] == [P1, P2] and stats.route == "pd"


def test_the_index_keeps_a_chain_and_forgets_the_oldest():
    index = PrefixIndex(pages_per_node=4)
    a, b = hashes_of(list(range(256))), hashes_of(list(range(1000, 1256)))
    index.add(D1, a)
    assert index.held_pages(D1, a) == 4 and index.held_pages(D1, a[:2] + b[2:]) == 2
    index.add(D1, b[:2])  # two newer pages push out a's last two (a chain is evicted from its tail)
    assert index.held_pages(D1, a) == 2 and index.held_pages(D1, b) == 2
    index.forget(D1)
    assert index.held_pages(D1, a) == 0

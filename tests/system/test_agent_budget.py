"""The staging budget and handoff lifecycle, against a real agent with a small budget."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from engine_adapters.failpoints import SLOW_CHUNK_SECONDS
from tandem_protocol.client import AgentClient, AgentHTTPError
from tandem_protocol.pages import PageGeometry
from tandem_protocol.wire import PeerError

from ..agents import TEST_KEY, AgentProcess, generate_request, pd_request, side_by_side, tokens_of, wait_for
from ..conftest import LONG_TEXT, prompt, run

PAGE = 1_474_560
GEOMETRY = PageGeometry(30, 3, 64)
TTL = 4.0
# one compute thread each, as tests/system/test_bad_input.py found: OpenMP threads that spin-wait
# on a busy core make every forward pass several times slower (the suite runs beside other work)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def small(smol_dir, tmp_path_factory):
    """A torch agent whose budget holds exactly one 130-token (3-page) prompt."""
    with AgentProcess(
        "torch",
        smol_dir,
        tmp_path_factory.mktemp("small"),
        *("--staging-bytes", str(3 * PAGE), "--handoff-ttl", str(TTL)),
        env=ONE_THREAD,
    ) as agent:
        yield agent


@pytest.fixture(scope="module")
def long_ids(small) -> list[int]:
    """The suite's long chat prompt (tests/conftest.py's `long_ids`), tokenized by the agent: no
    engine need load in this process."""
    with small.client() as c:
        r = c.post("/v1/tokenize", json={"messages": [{"role": "user", "content": LONG_TEXT}]})
    r.raise_for_status()
    return r.json()["token_ids"]


def idle(agent: AgentProcess) -> None:
    s = agent.status()
    assert (s["budget"]["reserved"], s["budget"]["waiting"], s["open_handoffs"], s["active_requests"]) == (
        0,
        0,
        0,
        0,
    ), s


async def create(agent, ids, handoff_id=None, wait_timeout=30.0, mode="commit-first"):
    c = AgentClient(agent.url, TEST_KEY)
    try:
        info = await c.info()
        return await c.create_handoff(
            handoff_id=handoff_id or uuid.uuid4().hex,
            token_ids=ids,
            sampling={"max_tokens": 4},
            mode=mode,
            contract=info["contract"]["fingerprint"],
            wait_timeout=wait_timeout,
        )
    finally:
        await c.aclose()


def test_a_prompt_larger_than_the_budget_streams_through_it(small, long_ids):
    """4 pages through a 3-page budget: the budget bounds the pages in host memory (a window),
    not the prompt; the answer is the engine's own."""
    ids, sampling = prompt(long_ids, 193), {"max_tokens": 4, "ignore_eos": True}
    lines = run(pd_request(small.url, small.url, ids, sampling))
    assert tokens_of(lines) == tokens_of(run(generate_request(small.url, ids, sampling)))
    idle(small)


def test_concurrent_requests_complete_in_fifo_order(small, long_ids):
    order: list[int] = []

    async def one(i: int):
        ids = prompt(long_ids, 130 - i)
        lines = await pd_request(small.url, small.url, ids, {"max_tokens": 4, "ignore_eos": True})
        tokens_of(lines)
        order.append(i)

    def arrived() -> int:
        s = small.status()
        return s["budget"]["waiting"] + s["totals"]["handoffs_created"]

    async def main():
        base = arrived()
        tasks = []
        for i in range(3):
            tasks.append(asyncio.create_task(one(i)))
            # let request i reach the agent (and queue) before request i+1 is sent
            deadline = time.monotonic() + 30
            while arrived() < base + i + 1:
                assert time.monotonic() < deadline, f"request {i} did not reach the agent in 30 s"
                await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)

    run(main())
    assert order == [0, 1, 2]
    idle(small)


def test_budget_wait_times_out_with_retry_after(small, long_ids):
    async def main():
        held = await create(small, prompt(long_ids, 130))  # fills the budget; nobody reads it
        try:
            with pytest.raises(AgentHTTPError) as e:
                await create(small, prompt(long_ids, 100), wait_timeout=0.3)
            assert e.value.status == 429
            async with httpx.AsyncClient() as c:  # the raw response carries Retry-After
                r = await c.post(
                    small.url + "/v1/handoffs",
                    headers={"Authorization": f"Bearer {TEST_KEY}"},
                    json={
                        "handoff_id": uuid.uuid4().hex,
                        "token_ids": prompt(long_ids, 100),
                        "contract": small.status()["contract"]["fingerprint"],
                        "wait_timeout": 0.2,
                    },
                )
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        finally:
            await AgentClient(small.url, TEST_KEY).cancel_handoff(held["handoff_id"])

    run(main())
    idle(small)


def test_cancel_a_waiting_and_a_streaming_request(small, long_ids):
    async def main():
        c = AgentClient(small.url, TEST_KEY)
        held = await create(small, prompt(long_ids, 130))
        waiting_id = uuid.uuid4().hex
        waiter = asyncio.create_task(create(small, prompt(long_ids, 100), handoff_id=waiting_id))
        while small.status()["budget"]["waiting"] < 1:
            await asyncio.sleep(0.05)
        assert (await c.cancel_handoff(waiting_id))["cancelled"]
        with pytest.raises(AgentHTTPError) as e:
            await waiter
        assert e.value.status == 499 and "cancelled while waiting" in str(e.value)
        # cancel the held handoff while a reader is attached: its stream ends with the reason, no hang
        # (None: this test reads frames without checking their contract)
        async with c.page_stream(held["handoff_id"], None, token=held["read_token"]) as stream:
            cancelled = (await c.cancel_handoff(held["handoff_id"]))["cancelled"]
            assert not (await c.cancel_handoff(held["handoff_id"]))["cancelled"]  # idempotent
            try:
                async for _ in stream:
                    pass  # a complete stream: every page had left before the cancel landed
            except PeerError as e:
                assert cancelled and "cancelled" in str(e)
        await c.aclose()

    run(main())
    idle(small)


def test_decoder_disconnect_releases_everything(small, long_ids):
    async def main():
        d = AgentClient(small.url, TEST_KEY)
        ids = prompt(long_ids, 130)
        stream = d.lines(
            "/v1/decode",
            {"token_ids": ids, "sampling": {"max_tokens": 200, "ignore_eos": True}, "prefill_url": small.url},
        )
        for _ in range(3):
            await stream.__anext__()
        await stream.aclose()  # the client goes away mid-answer
        await d.aclose()

    run(main())
    deadline = time.monotonic() + 60  # it ends at its next step: seconds on a loaded machine
    while small.status()["active_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    idle(small)


def test_unread_handoff_expires(small, long_ids):
    run(create(small, prompt(long_ids, 70)))
    assert small.status()["open_handoffs"] == 1
    # gone after its TTL: waited for, not slept (TTL + 1.5 s was too short at load average 8)
    wait_for(lambda: small.status()["open_handoffs"] == 0, TTL + 60)
    idle(small)
    with small.client() as c:
        assert 'tandem_handoffs_finished_total{outcome="expired"}' in c.get("/metrics").text


def test_a_prefill_longer_than_the_stall_timeout_and_the_lease_is_read_to_the_end(tiny_dir, tmp_path, long_ids):
    """A prefiller that computes longer than the decoder's stall timeout without a page to send
    (here its first chunk takes 8 s more, the decoder gives up after 3 s of silence) sends
    heartbeats; its lease (0.5 s) expires pages nobody reads, and the decoder reads from the start:
    a prefill that outlasts both is read to the end, the request completes P/D. The decoder is
    another agent: one agent as both would hold its one engine with the prefill before it could
    read. A silent link still stalls (tests/integration/test_faults). Both serve the tiny model
    (`tiny_dir`): the failpoint, not the weights, makes the prefill long, and the
    answer is compared with the same engine's."""
    slow = {"TANDEM_FAILPOINTS": "slow_prefill_chunk@1", **ONE_THREAD}
    with side_by_side(
        lambda: AgentProcess("torch", tiny_dir, tmp_path / "p", "--handoff-ttl", "0.5", env=slow),
        lambda: AgentProcess("torch", tiny_dir, tmp_path / "d", "--stall-timeout", "3", env=ONE_THREAD),
    ) as (p, d):
        ids = prompt(long_ids, 193)  # two chunks (the last page's own): pages follow the slow one
        lines = run(pd_request(p.url, d.url, ids, {"max_tokens": 4}))
        assert lines[-1].get("done"), lines[-1]
        # it did outlast the stall timeout and the lease
        assert lines[-1]["prefill_seconds"] >= SLOW_CHUNK_SECONDS, lines[-1]
        assert tokens_of(lines) == tokens_of(run(generate_request(d.url, ids, {"max_tokens": 4})))
        idle(p)
        idle(d)


def test_cancel_a_decoding_request_by_id(small, long_ids):
    async def main():
        d = AgentClient(small.url, TEST_KEY)
        ids = prompt(long_ids, 120)
        sampling = {"max_tokens": 300, "ignore_eos": True}
        lines = []
        async for line in d.lines(
            "/v1/decode",
            {"token_ids": ids, "sampling": sampling, "prefill_url": small.url, "request_id": "stop-me"},
        ):
            lines.append(line)
            if len(lines) == 3:
                assert (await d._json("DELETE", "/v1/requests/stop-me"))["cancelled"]
        await d.aclose()
        return lines

    lines = run(main())
    assert lines[-1]["error"]["type"] == "Cancelled" and len(lines) < 300
    idle(small)


def test_cli_status_bench_link_and_doctor(small):
    import os
    import subprocess

    from ..agents import TANDEM

    env = {**os.environ, "TANDEM_CLUSTER_KEY": TEST_KEY, "COLUMNS": "200"}

    def tandem(*args):
        result = subprocess.run([TANDEM, "agent", *args], capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    status = tandem("status", small.url, "--insecure-http")  # `small` serves plain HTTP
    assert "torch" in status and "budget" in status and f"of {3 * PAGE:,} bytes reserved" in status
    link = tandem("bench-link", small.url, "--pages", "20", "--insecure-http")
    assert "20 pages" in link and "MB/s" in link and "rtt" in link
    doctor = tandem("doctor")
    for section in ("packages", "engines", "accelerators", "model", "node"):
        assert section in doctor
    assert "OpenBLAS" in doctor or "Accelerate" in doctor

"""Continuous batching on the in-process engines (engine_adapters/decode_batch.py): requests that
run at once step together in one forward, and each gets exactly its own answer.

Batch invariance, measured on two CPU cores (16 distinct prompts, 24 and 64 greedy tokens): on
torch (float32 CPU, MKL) and MLX (float32 CPU, OpenBLAS) a request in a batch of 16 produced the
same tokens as alone, 16 of 16, so the rule asserted here is exactness, also for a P/D decode
inside a batch. A row's attention runs over its own cache only, and one row alone computes with
the engine's single-request forward.

These tests check the batching mechanism (rows stepped together, P/D decodes joining, cancels
freeing rows) on the tiny Llama (tests/conftest.py `tiny_engines`): the same code path at a
fraction of SmolLM2's cost. On the embedded model the same exactness is asserted through the
cluster: tests/integration/test_load.py's 64 streams on torch and MLX decoders each equal the
decoder alone."""

from __future__ import annotations

import asyncio

import pytest

from engine_adapters.base import EngineRequest
from node_agent.inprocess import run_pair
from tandem_protocol.errors import Cancelled
from tandem_protocol.handoff import FirstTokenMode
from tandem_protocol.sampling import SamplingParams

from ..conftest import LONG_TEXT, collect, run

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Count to five.",
    "Who wrote Hamlet?",
    "What is 2+2?",
    "Say hello in Spanish.",
    "What color is the sky?",
    "Name a fruit.",
    "What is the largest planet?",
    "Spell cat backwards.",
    "What do bees make?",
    "How many legs does a spider have?",
    "What is the opposite of hot?",
    "Name a famous painter.",
    "What language is spoken in Brazil?",
    "What is frozen water called?",
]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def prompts(adapter) -> list[list[int]]:
    return [adapter.chat_token_ids([{"role": "user", "content": q}]) for q in QUESTIONS]


def request(name: str, ids: list[int], sampling: SamplingParams = GREEDY) -> EngineRequest:
    return EngineRequest(name, ids, sampling)


@pytest.fixture(scope="module")
def engines(tiny_engines) -> dict:
    return tiny_engines


@pytest.fixture(scope="module")
def long_ids(engines) -> list[int]:
    return engines["torch"].chat_token_ids([{"role": "user", "content": LONG_TEXT}])


@pytest.fixture(scope="module")
def alone(engines) -> dict:
    """Each engine's answer to each question, one request at a time."""
    return {
        (name, i): run(collect(adapter.generate(request(f"alone-{name}-{i}", ids))))
        for name, adapter in engines.items()
        for i, ids in enumerate(prompts(adapter))
    }


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_a_request_in_a_batch_of_16_gets_its_own_answer_alone(engines, alone, engine):
    adapter = engines[engine]
    answers = [alone[engine, i] for i in range(16)]
    assert len({tuple(a) for a in answers}) == 16  # distinct answers: a mixed-up row would show

    async def all_at_once():
        adapter.batch.widest = 0
        got = await asyncio.gather(
            *[collect(adapter.generate(request(f"batch-{engine}-{i}", ids))) for i, ids in enumerate(prompts(adapter))]
        )
        widest = adapter.batch.widest
        return got, widest

    got, widest = run(all_at_once())
    assert widest == 16, widest  # every request stepped in one forward once all had prefilled
    assert got == answers


RL, CF = FirstTokenMode.RECOMPUTE_LAST, FirstTokenMode.COMMIT_FIRST


# each decoder in each mode, once from its own engine and once from the other
@pytest.mark.parametrize(
    "p, d, mode",
    [("torch", "torch", CF), ("mlx", "mlx", CF), ("torch", "mlx", RL), ("mlx", "torch", RL)],
    ids=lambda x: getattr(x, "value", x),
)
def test_a_pd_decode_inside_a_batch_equals_the_same_pd_decode_alone(engines, long_ids, p, d, mode):
    P, D = engines[p], engines[d]
    ids = list(long_ids)
    expected = run(collect(run_pair(P, D, ids, GREEDY, mode)))

    async def among_others():
        others = [
            collect(D.generate(request(f"other-{p}-{d}-{mode.value}-{i}", x))) for i, x in enumerate(prompts(D)[:7])
        ]
        D.batch.widest = 0
        got, *_ = await asyncio.gather(collect(run_pair(P, D, ids, GREEDY, mode)), *others)
        return got, D.batch.widest

    got, widest = run(among_others())
    assert widest >= 2, widest  # it decoded beside others
    assert got == expected


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_a_request_cancelled_mid_batch_frees_its_row_and_the_others_go_on(engines, alone, engine):
    adapter = engines[engine]
    ids = prompts(adapter)
    long = SamplingParams(max_tokens=64, ignore_eos=True)

    async def go():
        victim = request(f"victim-{engine}", ids[0], long)
        seen: list[int] = []

        async def cancelled_after_three():
            with pytest.raises(Cancelled):
                async for token in adapter.generate(victim):
                    seen.append(token)
                    if len(seen) == 3:
                        assert adapter.cancel(victim.request_id)

        async def closed_after_five():  # a client gone: its stream is closed, not cancelled
            stream = adapter.generate(request(f"gone-{engine}", ids[1], long))
            got = [await anext(stream) for _ in range(5)]
            await stream.aclose()
            return got

        results = await asyncio.gather(
            cancelled_after_three(),
            closed_after_five(),
            *[collect(adapter.generate(request(f"stays-{engine}-{i}", ids[i]))) for i in range(2, 6)],
        )
        return seen, results[1], results[2:]

    seen, gone, stayed = run(go())
    assert len(seen) <= 4  # stopped at the step after its cancel (one token may be on its way)
    assert gone == alone[engine, 1][:5]
    assert stayed == [alone[engine, i] for i in range(2, 6)]
    assert adapter.batch.rows == [] and adapter.active_requests == 0

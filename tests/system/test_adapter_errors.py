"""Failure paths of the adapters: each ends with its own clear error and releases the request.

What is checked is plumbing (chunks and pages, cancels, damaged streams, validation), so both
engines run a tiny random-weight Llama with SmolLM2's head_dim; the embedded model
is the other side of the contract-mismatch test."""

from __future__ import annotations

import numpy as np
import pytest

from engine_adapters.base import EngineRequest
from engine_adapters.in_process import InProcessEngine
from node_agent.inprocess import PairStats, run_pair
from tandem_protocol.contract import token_digest
from tandem_protocol.errors import Cancelled, ContractMismatch, FrameError, RequestError
from tandem_protocol.handoff import FirstTokenMode, PrefillDone
from tandem_protocol.pages import FrameExpectation, KVPage, decode_frame, frame_bytes
from tandem_protocol.sampling import SamplingParams

from ..conftest import TINY_LLAMA, collect, in_process_engines, make_tiny_checkpoint, prompt, run

ENGINES = ["torch", "mlx"]
# the tiny Llama of tests/conftest.py, with room for the 600-token prompts
TINY = {**TINY_LLAMA, "max_position_embeddings": 2048}


@pytest.fixture(scope="module")
def tiny(smol_dir, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("adapter-errors") / "tiny", "llama", smol_dir, seed=7, **TINY)
    yield from in_process_engines(path, context_length=1024)


def long_prompt(long_ids, n):
    return (list(long_ids) * (n // len(long_ids) + 1))[:n]


@pytest.mark.parametrize("engine", ENGINES)
def test_pages_leave_before_prefill_finishes(tiny, long_ids, engine, monkeypatch):
    adapter = tiny[engine]
    events = log_chunks(adapter, monkeypatch)
    ids = long_prompt(long_ids, 600)  # chunks of 256, 256, then 64, and the last page (24) on its own
    pages = run(prefill_events(adapter, ids, events))
    assert events == [
        ("chunk", 256),
        *[("page", i) for i in range(4)],
        ("chunk", 256),
        *[("page", i) for i in range(4, 8)],
        ("chunk", 64),
        ("page", 8),
        ("chunk", 24),
        ("page", 9),
        ("done", 600),
    ]
    # An asynchronous device (CUDA) collects a middle chunk's pages after queueing the next chunk:
    # the same pages, one chunk later; the first chunk's (the link starts at once) and those of
    # the chunks before and after the last page's without delay.
    events.clear()
    monkeypatch.setattr(adapter, "export_lag", 1)
    lagged = run(prefill_events(adapter, ids, events))
    assert events == [
        ("chunk", 256),
        *[("page", i) for i in range(4)],
        ("chunk", 256),
        ("chunk", 64),
        *[("page", i) for i in range(4, 9)],
        ("chunk", 24),
        ("page", 9),
        ("done", 600),
    ]
    assert [p.index for p in lagged] == list(range(10))
    assert all(np.array_equal(a.data, b.data) and a.valid_tokens == b.valid_tokens for a, b in zip(pages, lagged))
    assert adapter.prefill_chunks(1) == [(0, 1)] and adapter.prefill_chunks(64) == [(0, 64)]
    assert adapter.prefill_chunks(65) == [(0, 64), (64, 65)] and adapter.prefill_chunks(256) == [(0, 192), (192, 256)]
    assert adapter.prefill_chunks(513) == [(0, 256), (256, 512), (512, 513)]


def log_chunks(adapter, monkeypatch) -> list:
    """Record each chunk the adapter computes (with or without logits) in a list of events."""
    events = []
    overridden = type(adapter).forward_chunk is not InProcessEngine.forward_chunk  # else it calls forward
    for name in ("forward", "forward_chunk") if overridden else ("forward",):
        real = getattr(adapter, name)
        monkeypatch.setattr(
            adapter, name, lambda session, ids, real=real: (events.append(("chunk", len(ids))), real(session, ids))[1]
        )
    return events


async def prefill_events(adapter, ids, events) -> list[KVPage]:
    pages = []
    async for item in adapter.prefill(EngineRequest("overlap", ids, SamplingParams(max_tokens=1))):
        events.append(("page", item.index) if isinstance(item, KVPage) else ("done", item.kv_tokens))
        if isinstance(item, KVPage):
            pages.append(item)
    return pages


@pytest.mark.parametrize("engine", ENGINES)
def test_cancel_during_prefill_and_decode(tiny, long_ids, engine):
    adapter = tiny[engine]

    async def cancel_prefill():
        req = EngineRequest("cancel-p", long_prompt(long_ids, 600), SamplingParams(max_tokens=1))
        gen = adapter.prefill(req)
        assert isinstance(await gen.__anext__(), KVPage)
        assert adapter.cancel("cancel-p") and adapter.cancel("cancel-p")  # idempotent
        with pytest.raises(Cancelled):
            async for _ in gen:
                pass

    async def cancel_generate():
        req = EngineRequest("cancel-g", prompt(long_ids, 70), SamplingParams(max_tokens=30, ignore_eos=True))
        gen = adapter.generate(req)
        await gen.__anext__()
        adapter.cancel("cancel-g")
        with pytest.raises(Cancelled):
            async for _ in gen:
                pass

    run(cancel_prefill())
    run(cancel_generate())
    assert adapter.active_requests == 0
    assert not adapter.cancel("cancel-p")


async def framed_stream(prefiller, ids, mutate=None, expect_ids=None, drop_done=False, stop_after=None):
    """P's prefill as the decoder would receive it over the wire, optionally damaged on the way."""
    handoff_id, digest = b"r" * 16, token_digest(ids)
    expect = FrameExpectation(
        prefiller.contract.fingerprint_bytes, handoff_id, token_digest(expect_ids or ids), prefiller.geometry
    )
    req = EngineRequest("wire-p", ids, SamplingParams(max_tokens=1))
    sent = 0
    async for item in prefiller.prefill(req):
        if isinstance(item, PrefillDone):
            if not drop_done:
                yield item
            continue
        if stop_after is not None and sent == stop_after:
            continue
        frame = bytearray(
            frame_bytes(item, contract=prefiller.contract.fingerprint_bytes, handoff_id=handoff_id, tokens=digest)
        )
        if mutate:
            mutate(item.index, frame)
        yield decode_frame(bytes(frame), expect)[1]
        sent += 1


def flip_bit_in_page_1(index, frame):
    if index == 1:
        frame[5000] ^= 0x10


@pytest.mark.parametrize(
    "damage, error, message",
    [
        (dict(mutate=flip_bit_in_page_1), FrameError, "checksum mismatch on page 1"),
        (dict(stop_after=1), FrameError, "ended after 1 of 3 pages"),
        (dict(drop_done=True), FrameError, "without the prefiller's final frame"),
        (dict(expect_ids="other"), ContractMismatch, "token_ids"),
    ],
)
@pytest.mark.parametrize("engine", ENGINES)
def test_damaged_streams_fail_cleanly(tiny, long_ids, engine, damage, error, message):
    adapter = tiny[engine]
    ids = prompt(long_ids, 150)
    if damage.get("expect_ids") == "other":
        damage = {"expect_ids": prompt(long_ids, 149) + [7]}
    req = EngineRequest("damaged-d", ids, SamplingParams(max_tokens=4), FirstTokenMode.COMMIT_FIRST)
    with pytest.raises(error, match=message):
        run(collect(adapter.decode(req, framed_stream(adapter, ids, **damage))))
    assert adapter.active_requests == 0


def test_out_of_order_pages_are_refused(tiny, long_ids):
    adapter = tiny["torch"]
    ids = prompt(long_ids, 150)

    async def swapped():
        items = await collect(adapter.prefill(EngineRequest("swap-p", ids, SamplingParams(max_tokens=1))))
        for item in [items[1], items[0], *items[2:]]:
            yield item

    with pytest.raises(FrameError, match="page 1 arrived where page 0 was expected"):
        run(collect(adapter.decode(EngineRequest("swap-d", ids, SamplingParams(max_tokens=2)), swapped())))
    assert adapter.active_requests == 0


def test_pair_refuses_a_different_model(engines, tiny):
    with pytest.raises(ContractMismatch) as e:
        run(collect(run_pair(tiny["torch"], engines["mlx"], [1, 2, 3], SamplingParams(max_tokens=2))))
    assert {"weights", "config", "context_length"} <= set(e.value.fields)


def test_bad_requests(tiny):
    adapter = tiny["torch"]
    cases = [
        ([], SamplingParams(), "empty"),
        ([1, 2, 10**9], SamplingParams(), "token ids must be integers"),
        ([1] * 100, SamplingParams(max_tokens=adapter.context_length), "exceeds the context length"),
    ]
    for ids, sampling, message in cases:
        with pytest.raises(RequestError, match=message):
            run(collect(adapter.generate(EngineRequest("bad", ids, sampling))))
    assert adapter.active_requests == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_seeded_sampling_pd_equals_local(tiny, long_ids, engine):
    adapter = tiny[engine]
    ids = prompt(long_ids, 100)
    sampling = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    local = run(collect(adapter.generate(EngineRequest("seeded", ids, sampling))))
    for mode in FirstTokenMode:
        assert run(collect(run_pair(adapter, adapter, ids, sampling, mode))) == local
    other_seed = SamplingParams(**{**sampling.__dict__, "seed": 99})
    assert run(collect(adapter.generate(EngineRequest("seeded", ids, other_seed)))) != local


def test_pair_stats_and_early_stop(tiny, long_ids):
    p, d = tiny["torch"], tiny["mlx"]
    stats = PairStats()
    out = run(
        collect(
            run_pair(
                p,
                d,
                prompt(long_ids, 130),
                SamplingParams(max_tokens=3, ignore_eos=True),
                FirstTokenMode.COMMIT_FIRST,
                stats,
            )
        )
    )
    assert len(out) == 3 and stats.pages == 3 and stats.kv_tokens == 130 and stats.ttft_seconds > 0
    assert len(stats.page_arrivals) == 3 and p.active_requests == d.active_requests == 0


@pytest.mark.parametrize("name", ["torch", "mlx"])
def test_sampling_an_engine_cannot_honour_is_refused(tiny, name):
    """torch and MLX sample with Tandem's own sampler, which has no min_p and no penalties: as
    commit-first prefillers (they sample the first token) they refuse min_p and the repetition
    penalty, which change a first token, but not the output-only penalties; generating, they
    refuse all four. Everything is refused before any work, naming the engine and parameter."""
    engine = tiny[name]
    hot = SamplingParams(temperature=0.7, top_k=5, max_tokens=4)
    for params in (SamplingParams(min_p=0.1), SamplingParams(repetition_penalty=1.2, temperature=0.5)):
        field = "min_p" if params.min_p else "repetition_penalty"
        with pytest.raises(RequestError, match=rf"prefill engine \({name}\).*cannot apply {field}"):
            engine.validate(EngineRequest("r", [1, 2, 3], params, FirstTokenMode.COMMIT_FIRST), generates=False)
        with pytest.raises(RequestError, match=rf"decode engine \({name}\) cannot apply {field}"):
            engine.validate(EngineRequest("r", [1, 2, 3], params), generates=True)
        # a recompute-last prefill samples nothing: the decoder's sampling is what matters
        engine.validate(EngineRequest("r", [1, 2, 3], params, FirstTokenMode.RECOMPUTE_LAST), generates=False)
    output_only = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3)
    engine.validate(EngineRequest("r", [1, 2, 3], output_only, FirstTokenMode.COMMIT_FIRST), generates=False)
    with pytest.raises(RequestError, match="cannot apply frequency_penalty, presence_penalty"):
        engine.validate(EngineRequest("r", [1, 2, 3], output_only), generates=True)
    for mode in FirstTokenMode:
        engine.validate(EngineRequest("r", [1, 2, 3], hot, mode), generates=False)
    engine.validate(EngineRequest("r", [1, 2, 3], hot), generates=True)


@pytest.mark.parametrize("engine", ENGINES)
def test_commit_first_token_leaves_before_the_last_imports(tiny, long_ids, engine, monkeypatch):
    """Commit-first: P's token is streamed once the whole page stream has arrived and been
    checked, while D's engine thread is still importing; the second token waits for every import.
    Recompute-last computes its first token, so it waits for the imports too. (P is the other
    engine: one adapter in both roles would queue P's release behind D's imports.)"""
    import time

    d, p = tiny[engine], tiny["mlx" if engine == "torch" else "torch"]
    real_import = d.import_kv
    imported = []

    def slow_import(session, start, kv):
        time.sleep(0.15)
        real_import(session, start, kv)
        imported.append(time.perf_counter())

    ids = prompt(long_ids, 200)  # 4 pages
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    for mode in FirstTokenMode:
        reference = run(collect(run_pair(p, d, ids, sampling, mode)))
        imported.clear()
        monkeypatch.setattr(d, "import_kv", slow_import)
        stamps = []

        async def consume(mode=mode, stamps=stamps):
            async for token in run_pair(p, d, ids, sampling, mode):
                stamps.append((token, time.perf_counter()))

        run(consume())
        monkeypatch.setattr(d, "import_kv", real_import)
        assert [t for t, _ in stamps] == reference and len(imported) == 4
        if mode is FirstTokenMode.COMMIT_FIRST:
            assert stamps[0][1] < imported[-1] < stamps[1][1]
        else:
            assert imported[-1] < stamps[0][1]
        assert p.active_requests == d.active_requests == 0

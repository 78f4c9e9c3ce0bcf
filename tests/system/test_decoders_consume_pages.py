"""Every decoder computes with the pages it is sent, not with a prompt it recomputed.

A torch prefiller agent runs with the `perturb_k` failpoint (engine_adapters/failpoints.py) armed
for its first two handoffs: their pages leave with K of one layer negated, framed and checksummed
like any page, so every decoder accepts them. Each decoder — torch, MLX, vLLM, SGLang — then
decodes the same prompt from perturbed and from true pages of that agent:

- perturbed: the first-step log-probabilities move far past the cross-engine tolerance and the
  greedy output differs from the reference (a decoder that ignored the pages would not notice);
- true: the greedy output equals the reference, and for the server decoders the first-step
  log-probabilities differ from the reference by more than 0 (torch's pages are not bit-equal
  to the engine's own: an engine that recomputed the prompt would match its reference exactly)
  and less than the tolerance;
- the engines' own counters: vLLM (recompute-last) computed one prompt token and loaded the rest
  from the connector; SGLang (commit-first) computed none.

References: torch and MLX their own prefill; vLLM vLLM alone (the same server, no pages);
SGLang a plain SGLang server (same model and CPU recipe, no disaggregation), never Tandem's
bridge. Log-probabilities compared: the tokens in both top-20 lists of the step after the prompt
(vLLM, torch, MLX: recompute-last) or after the prefiller's first token (SGLang: commit-first).
Figures go to reports/consume_pages_*.json.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import numpy as np
import pytest

from engine_adapters.base import EngineRequest
from engine_adapters.failpoints import PERTURBED_LAYER
from tandem_protocol.client import AgentClient
from tandem_protocol.errors import FrameError
from tandem_protocol.handoff import FirstTokenMode
from tandem_protocol.pages import KVPage, PageGeometry, make_page
from tandem_protocol.sampling import SamplingParams

from ..agents import TEST_KEY, AgentProcess, wait_for
from ..conftest import collect, own_greedy, run, write_report
from ..engine_probes import sglang_decode_step_logprobs, vllm_first_step_logprobs
from ..integration.rules import LOGIT_TOLERANCE, logits_after_import
from ..server_engines import counter, server_metrics
from .conftest import fresh_salt

RL, CF = FirstTokenMode.RECOMPUTE_LAST, FirstTokenMode.COMMIT_FIRST
PERTURB = {"TANDEM_FAILPOINTS": "perturb_k@1,perturb_k@2"}  # the prefiller's first two handoffs
MAX_TOKENS = 16
TOP = 20

# Measured here (one 219-token prompt, 16 greedy tokens; server engines on one thread each), max
# |Δ log p| over the tokens in both top-20 lists against the reference — perturbed pages: torch
# 1.05, MLX 1.05, vLLM 1.04, SGLang 3.08; true pages: torch 0.0025, MLX 0.0019 (0.0041, every
# run, on an AMD EPYC without AVX512-FP16: OpenBLAS runs other kernels there), vLLM 0.0084 in the
# whole suite and 0.0212 with this module alone (vLLM CPU is not batch-invariant; 0.0084 again on
# the shared server of tests/system/conftest.py, prefill chunks of 128, with this module after
# test_prefix_cache in one process), SGLang 0.039 (tolerance 0.1). Perturbed pages must move it by
# at least half of that (and by at least 5x the tolerance), true pages by at most twice the largest.
PERTURBED_AT_LEAST = {"torch": 0.52, "mlx": 0.52, "vllm": 0.52, "sglang": 1.5}
TRUE_AT_MOST = {"torch": 0.005, "mlx": 0.0083, "vllm": 0.043, "sglang": 0.077}


# ---- the prefiller and its pages ---------------------------------------------------------------
@pytest.fixture(scope="module")
def prompt_ids(engines, long_ids) -> list[int]:
    return list(long_ids)  # 219 tokens, four pages


@pytest.fixture(scope="module")
def handoffs(smol_dir, tmp_path_factory, prompt_ids) -> dict:
    """(perturbed | true, mode) -> the prefiller's pages and final item, read off its page stream.
    The first two handoffs are the perturbed ones (PERTURB), so the order here matters."""
    home = tmp_path_factory.mktemp("consume-pages")
    with AgentProcess("torch", smol_dir, home / "p", env=PERTURB) as p:
        return {
            (kind, mode): run(pages_and_done(p, prompt_ids, mode))
            for kind in ("perturbed", "true")
            for mode in (RL, CF)
        }


async def pages_and_done(agent: AgentProcess, ids: list[int], mode: FirstTokenMode) -> list:
    """One handoff of `ids` on `agent`: its pages (KVPage) and its PrefillDone, as a decoder receives them."""
    client = AgentClient(agent.url, TEST_KEY)
    try:
        info = await client.info()
        handoff_id = uuid.uuid4().hex
        created = await client.create_handoff(
            handoff_id=handoff_id,
            token_ids=ids,
            sampling={"max_tokens": 1},
            mode=mode.value,
            contract=info["contract"]["fingerprint"],
        )
        async with client.page_stream(handoff_id, None, token=created["read_token"]) as stream:
            return [item async for item in stream]
    finally:
        await client.aclose()


def pages(items: list) -> list[KVPage]:
    return [x for x in items if isinstance(x, KVPage)]


async def replay(items: list):
    """A received page stream, again, for a decoder's `decode`."""
    for item in items:
        yield item


def test_the_failpoint_negates_k_of_one_layer_and_nothing_else(handoffs):
    """The premise of the tests below: perturbed pages differ from true ones in K of one layer."""
    for mode in (RL, CF):
        bad, good = handoffs["perturbed", mode], handoffs["true", mode]
        assert [(p.index, p.valid_tokens) for p in pages(bad)] == [(p.index, p.valid_tokens) for p in pages(good)]
        assert bad[-1].first_token == good[-1].first_token  # P's own compute is untouched
        for b, g in zip(pages(bad), pages(good), strict=True):
            negated = g.kv.copy()
            negated[PERTURBED_LAYER, 0] *= -1
            assert np.array_equal(b.kv, negated), (mode, b.index)
            assert not np.array_equal(b.kv, g.kv), (mode, b.index)


# ---- measuring -------------------------------------------------------------------------------
def top_logprobs(logits: np.ndarray, top: int = TOP) -> dict[int, float]:
    x = logits.astype(np.float64).ravel()
    logp = x - x.max() - np.log(np.exp(x - x.max()).sum())
    return {int(t): float(logp[t]) for t in np.argsort(-logp)[:top]}


def logprob_diff(got: dict[int, float], ref: dict[int, float]) -> dict:
    """max |Δ log p| over the tokens in both top lists, and whether the most likely token moved."""
    shared = set(got) & set(ref)
    assert shared, "no token in both top lists"
    return {
        "max_abs_diff": max(abs(got[t] - ref[t]) for t in shared),
        "shared_top_tokens": len(shared),
        "top_token_equal": max(got, key=got.get) == max(ref, key=ref.get),
    }


def check(decoder: str, figures: dict) -> None:
    """The assertions every decoder answers to, on `figures` (written to the report first)."""
    write_report(f"consume_pages_{decoder}", {**figures, "tolerance": LOGIT_TOLERANCE})
    perturbed, true = figures["perturbed"], figures["true"]
    # half the measured figure, and "well past" the cross-engine tolerance (5x), whichever is more
    assert perturbed["logprobs"]["max_abs_diff"] >= max(PERTURBED_AT_LEAST[decoder], 5 * LOGIT_TOLERANCE), figures
    assert not perturbed["greedy_equal"], figures
    assert true["logprobs"]["max_abs_diff"] <= min(TRUE_AT_MOST[decoder], LOGIT_TOLERANCE), figures
    assert true["greedy_equal"], figures


def sampling() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


# ---- torch and MLX ---------------------------------------------------------------------------
# The engine servers of the tests after these start with them, side by side (the prefiller agent
# is gone by then: one process fewer beside four server starts; tests/system/conftest.py).
@pytest.mark.usefixtures("servers_start_now")
@pytest.mark.parametrize("decoder", ["torch", "mlx"])
def test_in_process_decoders_consume_the_pages(engines, handoffs, prompt_ids, decoder):
    """First-step log-probabilities over the imported pages of prompt[:-1] against the decoder's
    own prefill; greedy output of `decode` (both first-token modes) against its own greedy run.
    The four decodes (perturbed and true pages, both modes) go at once: the decoder is exact in a
    batch (tests/system/test_batching.py)."""
    d, ids = engines[decoder], prompt_ids
    own = own_greedy(d, ids, MAX_TOKENS)
    figures = {"decoder": decoder, "prompt_tokens": len(ids), "perturbed_layer_k": PERTURBED_LAYER}
    cases = [(kind, mode) for kind in ("perturbed", "true") for mode in (RL, CF)]

    async def decode_all() -> list[list[int]]:
        return await asyncio.gather(
            *(
                collect(
                    d.decode(EngineRequest(f"{kind}-{mode.value}", ids, sampling(), mode), replay(handoffs[kind, mode]))
                )
                for kind, mode in cases
            )
        )

    outputs = dict(zip(cases, run(decode_all()), strict=True))
    for kind in ("perturbed", "true"):
        imported, local = run(logits_after_import(d, pages(handoffs[kind, RL]), ids))
        greedy = {mode.value: outputs[kind, mode] for mode in (RL, CF)}
        figures[kind] = {
            "logprobs": logprob_diff(top_logprobs(imported), top_logprobs(local)),
            "greedy_equal_by_mode": {m: out == own for m, out in greedy.items()},
        }
        equal = figures[kind]["greedy_equal_by_mode"].values()
        figures[kind]["greedy_equal"] = all(equal) if kind == "true" else any(equal)
    check(decoder, figures)


# ---- vLLM and SGLang -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(vllm_server, sglang_server, plain_sglang_server):
    """A vLLM adapter, an SGLang adapter in its decode role and a plain SGLang server (radix cache
    off), one thread each: the session's shared servers (tests/system/conftest.py), started side
    by side. vLLM's and SGLang's prefix caches are on: every request to them below carries a cache
    salt of its own (fresh_salt), so every page is computed and sent, every run."""
    return {"vllm": vllm_server, "sglang": sglang_server, "plain": plain_sglang_server}


def grown(read, before: str, name: str, label: str, values: tuple[str, ...], total: int) -> dict:
    """How much each `label` value of counter `name` grew since `before` (Prometheus text from
    `read()`), once the growths add up to `total`: a server counts a request a moment after it
    answered (its counters have no event to wait on)."""
    growth = {}

    def done() -> bool:
        now = read()
        growth.update({x: counter(now, name, **{label: x}) - counter(before, name, **{label: x}) for x in values})
        return sum(growth.values()) >= total

    try:
        wait_for(done, timeout=20, step=0.1)
    except AssertionError:
        raise AssertionError(f"{name} grew by {growth} after 20 s, short of {total}") from None
    return growth


def test_vllm_decoder_consumes_the_pages(servers, handoffs, prompt_ids):
    """vLLM decodes (recompute-last) from torch's pages of prompt[:-1], against vLLM alone:
    log-probabilities of the first decode step (vLLM's completions `logprobs`), greedy output
    of the adapter's `decode`, and vLLM's `prompt_tokens_by_source` counters for that request."""
    v, ids = servers["vllm"], prompt_ids
    name, sources = "vllm:prompt_tokens_by_source_total", ("local_compute", "local_cache_hit", "external_kv_transfer")

    def by_source(before: str) -> dict:
        return grown(lambda: server_metrics(v.server.url), before, name, "source", sources, len(ids))

    before = server_metrics(v.server.url)
    alone = run(collect(v.generate(EngineRequest("alone", ids, sampling(), cache_salt=fresh_salt("alone")))))
    figures = {
        "decoder": "vllm",
        "prompt_tokens": len(ids),
        "perturbed_layer_k": PERTURBED_LAYER,
        "alone": {"prompt_tokens_by_source": by_source(before)},
    }
    reference = run(vllm_first_step_logprobs(v, ids, cache_salt=fresh_salt("reference")))
    for kind in ("perturbed", "true"):
        items = handoffs[kind, RL]
        logprobs = run(vllm_first_step_logprobs(v, ids, pages(items), cache_salt=fresh_salt(f"{kind}-logprobs")))
        before = server_metrics(v.server.url)
        req = EngineRequest(kind, ids, sampling(), RL, cache_salt=fresh_salt(kind))
        out = run(collect(v.decode(req, replay(items))))
        figures[kind] = {
            "logprobs": logprob_diff(logprobs, reference),
            "greedy_equal": out == alone,
            "prompt_tokens_by_source": by_source(before),
        }
    check("vllm", figures)
    assert figures["alone"]["prompt_tokens_by_source"]["local_compute"] == len(ids), figures  # the counter counts
    for kind in ("perturbed", "true"):
        counted = figures[kind]["prompt_tokens_by_source"]
        assert counted["local_compute"] <= 1 and counted["external_kv_transfer"] == len(ids) - 1, figures
    assert figures["true"]["logprobs"]["max_abs_diff"] > 0, figures  # torch's pages, not vLLM's own


def plain_generate(plain, ids: list[int], max_tokens: int, top: int = 0) -> dict:
    """One greedy request on the plain SGLang server (its /generate), with top log-probabilities when `top`."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    }
    if top:
        body.update(return_logprob=True, top_logprobs_num=top)
    r = httpx.post(
        plain.url + "/generate", json=body, headers={"Authorization": f"Bearer {plain.api_key}"}, timeout=300
    )
    r.raise_for_status()
    return r.json()


def test_sglang_decoder_consumes_the_pages(servers, handoffs, prompt_ids):
    """SGLang's decode role continues (commit-first) from torch's pages of the whole prompt and
    torch's first token, against a plain SGLang server: top log-probabilities of the step after
    that token (SGLang's `return_logprob`), greedy output of the adapter's `decode`, and SGLang's
    `realtime_tokens_total{mode="prefill_compute"}` counter for that request."""
    s, plain, ids = servers["sglang"], servers["plain"], prompt_ids
    name, modes = "sglang:realtime_tokens_total", ("prefill_compute", "prefill_cache", "decode")

    def by_mode(url: str, before: str, total: int) -> dict:
        return grown(lambda: server_metrics(url), before, name, "mode", modes, total)

    before = server_metrics(plain.url)
    alone = plain_generate(plain, ids, MAX_TOKENS)["output_ids"]
    figures = {
        "decoder": "sglang",
        "reference": "a plain SGLang server (no disaggregation)",
        "prompt_tokens": len(ids),
        "perturbed_layer_k": PERTURBED_LAYER,
        # the plain server's own answer: every prompt token computed, one token less decoded
        "plain_tokens_by_mode": by_mode(plain.url, before, len(ids) + MAX_TOKENS - 1),
    }
    for kind in ("perturbed", "true"):
        items = handoffs[kind, CF]
        first = items[-1].first_token
        salt = fresh_salt(f"{kind}-logprobs")
        logprobs = run(sglang_decode_step_logprobs(s, ids, first, pages(items), cache_salt=salt))
        steps = plain_generate(plain, ids + [first], 1, TOP)["meta_info"]["output_top_logprobs"]
        reference = {int(token): float(logprob) for logprob, token, *_ in steps[0]}
        before = server_metrics(s.server.url)
        req = EngineRequest(kind, ids, sampling(), CF, cache_salt=fresh_salt(kind))
        out = run(collect(s.decode(req, replay(items))))
        figures[kind] = {
            "logprobs": logprob_diff(logprobs, reference),
            "greedy_equal": out == alone,
            "tokens_by_mode": by_mode(s.server.url, before, MAX_TOKENS - 1),
        }
    check("sglang", figures)
    assert figures["plain_tokens_by_mode"]["prefill_compute"] == len(ids), figures  # the counter counts
    for kind in ("perturbed", "true"):
        # no prompt token computed, and every output token but the prefiller's first decoded here
        # (15 of 16 measured, as the plain server; SGLang's overlap scheduler, off on a CPU, counts 16)
        assert figures[kind]["tokens_by_mode"] == {
            "prefill_compute": 0,
            "prefill_cache": 0,
            "decode": MAX_TOKENS - 1,
        }, figures
    assert figures["true"]["logprobs"]["max_abs_diff"] > 0, figures  # torch's pages, not SGLang's own


def test_broken_page_streams_inside_the_adapter_release_sglangs_slots(sglang_server, engines, long_ids):
    """The adapter's own checks on a stream handed to SGLang's decode role: a missing page, pages
    out of order and a page of the wrong shape; each fails and SGLang frees the slots it held. On
    the adapter itself: an agent's frame reader stops such streams before its adapter sees them."""
    ids = list(long_ids[:200])
    items = run(collect(engines["torch"].prefill(EngineRequest("src", ids, SamplingParams(max_tokens=1)))))
    pages, done = [x for x in items if isinstance(x, KVPage)], items[-1]
    g = engines["torch"].geometry
    wrong = make_page(PageGeometry(g.layers, 2, g.head_dim), 1, pages[1].kv[:, :, :, :2])  # 2 KV heads, not 3
    for name, stream, expect in (
        ("missing", pages[:2] + pages[3:], "arrived where page 2 was expected"),
        ("out_of_order", [pages[1], pages[0]] + pages[2:], "out of order"),
        ("wrong_shape", [pages[0], wrong] + pages[2:], "shape"),
    ):

        async def feed(seq=stream + [done]):
            for x in seq:
                yield x

        with pytest.raises(FrameError, match=expect):
            req = EngineRequest(name, ids, SamplingParams(max_tokens=4), cache_salt=fresh_salt(name))
            run(collect(sglang_server.decode(req, feed())))
        # SGLang's used tokens leave out what its radix cache keeps unlocked: 0 once no request holds slots
        wait_for(lambda: not run(sglang_server.engine_stats())["kv_tokens_used"], 20, step=0.1)
        assert sglang_server.active_requests == 0

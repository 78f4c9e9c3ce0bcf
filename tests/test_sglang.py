"""Real SGLang (0.5.23 on its CPU engine, in .venv-sglang) as prefiller and decoder through
Tandem's transfer backend, through agents and the panel.

Two SGLang agents (one starts in its prefill role, one in its decode role; either switches when
asked for the other), a torch, an MLX and a vLLM agent run as separate processes; the panel
exposes every pair with SGLang on one side. Figures go to reports/sglang_*.json.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import numpy as np
import openai
import pytest

from engine_adapters.base import EngineRequest
from engine_adapters.settings import EngineSettings
from engine_adapters.sglang_adapter import sglang_environment
from tandem_cli.bench_ttft import prompt_ids
from tandem_protocol.client import AgentClient
from tandem_protocol.errors import FrameError
from tandem_protocol.pages import KVPage, PageGeometry, make_page
from tandem_protocol.sampling import SamplingParams

from .agents import (
    TEST_KEY,
    AgentProcess,
    TamperProxy,
    decode_foreign_pages,
    generate_request,
    pd_request,
    settle,
    tokens_of,
    wait_until_streaming,
)
from .conftest import collect, prompt, run, write_report
from .engine_probes import sglang_decode_step_logprobs
from .fuzzing import VOCAB, fuzz_engine_routes
from .server_engines import (
    QUESTION,
    at_engine_baseline,
    check_damaged_streams_through_panel,
    check_engine_crash_through_panel,
    check_every_direction,
    check_load_through_panel,
    check_pages_against_transformers,
    check_panel_restart,
    check_peer_kills_through_panel,
    check_prefiller_rules,
    check_slow_link_through_panel,
    check_soak_through_panel,
    engine_cluster,
)

PAIRS = {
    "s2m": ("sglang", "mlx"),
    "m2s": ("mlx", "sglang2"),
    "s2t": ("sglang", "torch"),
    "t2s": ("torch", "sglang2"),
    "s2s": ("sglang", "sglang2"),
    "s2v": ("sglang", "vllm"),
    "v2s": ("vllm", "sglang2"),
}


@pytest.fixture(scope="module")
def cluster(smol_dir, tmp_path_factory):
    try:
        sglang_environment(EngineSettings())
    except Exception as e:
        pytest.fail(f"SGLang is part of `make test`: {e}")
    home = tmp_path_factory.mktemp("sglang")
    # equal thread counts: same-engine outputs comparable bit for bit
    os.environ.setdefault("TANDEM_SGLANG_THREADS", "1")
    os.environ.setdefault("TANDEM_VLLM_THREADS", "1")
    agents = {
        "sglang": ("sglang", {"TANDEM_SGLANG_ROLE": "prefill"}),
        "sglang2": ("sglang", {"TANDEM_SGLANG_ROLE": "decode"}),
        **{name: (name, {}) for name in ("torch", "mlx", "vllm")},
    }
    with engine_cluster(smol_dir, home, agents, PAIRS, tampered=("sglang", "sglang2")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def sglang_engine(smol_dir):
    """SGLang driven from this process through its adapter, for its log-probabilities."""
    from engine_adapters import load_adapter

    os.environ.setdefault("TANDEM_SGLANG_THREADS", "1")
    adapter = load_adapter("sglang", smol_dir)
    yield adapter
    adapter.close()


def pool_used(agent: AgentProcess) -> float:
    """Tokens of SGLang's KV pool held by requests (SGLang's own gauge)."""
    return agent.status()["engine_stats"]["kv_tokens_used"]


def at_baseline(*agents: AgentProcess, timeout: float = 20.0) -> None:
    """Agents idle, and every SGLang among them back to an empty token pool."""
    settle(*agents)
    deadline = time.monotonic() + timeout
    sglangs = [a for a in agents if a.engine == "sglang"]
    while any(pool_used(a) for a in sglangs):
        assert time.monotonic() < deadline, {a.url: a.status()["engine_stats"] for a in sglangs}
        time.sleep(0.1)


def test_sglang_pages_equal_transformers_reference(cluster, engines, long_ids):
    """Page bytes read out of SGLang's pool against the K/V transformers computes for the same prompt."""
    check_pages_against_transformers(cluster["sglang"], engines["torch"], long_ids, "sglang_pages")
    at_baseline(cluster["sglang"])


def test_every_direction_through_the_panel(cluster, long_ids):
    check_every_direction(cluster, PAIRS, "s2s", long_ids, "sglang_directions")
    stats = {name: cluster[name].status()["engine_stats"] for name in ("sglang", "sglang2")}
    write_report("sglang_role_switches", {name: s["role_switches"] for name, s in stats.items()})
    at_baseline(*(cluster[name] for name in ("sglang", "sglang2")))


def test_sampling_a_prefiller_cannot_honour_is_refused_before_anything_runs(cluster):
    """MLX samples the first token of MLX -> SGLang but has no min_p or repetition penalty: the
    panel answers 400 before either role is scheduled. The same parameters are honoured where
    both engines can (SGLang -> SGLang), and an MLX decoder refuses them too."""
    client, mlx, sg = cluster["client"], cluster["mlx"], cluster["sglang2"]
    before = (mlx.status()["totals"], sg.status()["totals"])
    for model, extra, engine in (
        ("m2s", {"min_p": 0.05}, "mlx"),
        ("m2s", {"repetition_penalty": 1.2}, "mlx"),
        ("s2m", {"min_p": 0.05}, "mlx"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, extra_body=extra)
        message = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
        assert engine in message and next(iter(extra)) in message, message
    assert (mlx.status()["totals"], sg.status()["totals"]) == before  # nothing prefilled, nothing decoded
    text = (
        client.chat.completions.create(
            model="s2s",
            messages=QUESTION,
            max_tokens=20,
            temperature=0,
            extra_body={"min_p": 0.05, "repetition_penalty": 1.1},
        )
        .choices[0]
        .message.content
    )
    assert "Paris" in text
    write_report(
        "sglang_sampling_refusals",
        {
            "m2s_min_p": "400",
            "m2s_repetition_penalty": "400",
            "s2m_min_p": "400",
            "s2s_min_p_and_repetition_penalty": text,
        },
    )


# The statistical rules run on the headline directions, SGLang <-> MLX (20 prompts, 32 greedy tokens
# each, ~2.5 min per direction on two cores); SGLang <-> torch is held to greedy agreement with the
# decoder alone at every page-boundary length by test_every_direction_through_the_panel.
@pytest.mark.parametrize("decoder", ["mlx"])
def test_sglang_prefill_meets_the_cross_engine_rules(cluster, engines, decoder):
    """The core issue's rules for SGLang -> torch and SGLang -> MLX over its 20 chat prompts."""
    check_prefiller_rules(cluster["sglang"], cluster[decoder], engines[decoder], f"sglang->{decoder}")


@pytest.mark.parametrize("prefiller", ["mlx"])
def test_sglang_decoder_meets_the_cross_engine_rules(cluster, engines, prefiller, sglang_engine):
    """X -> SGLang over the core issue's 20 chat prompts: SGLang's top-20 log-probabilities at its
    first decode step (its API exposes those, not logits) with X's pages against with its own
    pages (same first token, so only the KV differs), and greedy agreement with SGLang alone."""
    from .test_cross_engine import LOGIT_TOLERANCE, MIN_AGREEMENT, PROMPTS

    p = engines[prefiller]
    sampling = {"max_tokens": 32, "ignore_eos": True}
    diffs, agree = [], 0
    for i, text in enumerate(PROMPTS):
        ids = p.chat_token_ids([{"role": "user", "content": text}])
        theirs = run(collect(p.prefill(EngineRequest(f"x-{i}", ids, SamplingParams(max_tokens=1)))))
        ours = run(collect(sglang_engine.prefill(EngineRequest(f"s-{i}", ids, SamplingParams(max_tokens=1)))))
        first = theirs[-1].first_token
        imported = run(
            sglang_decode_step_logprobs(sglang_engine, ids, first, [x for x in theirs if isinstance(x, KVPage)])
        )
        local = run(sglang_decode_step_logprobs(sglang_engine, ids, first, [x for x in ours if isinstance(x, KVPage)]))
        shared = set(imported) & set(local)
        assert max(imported, key=imported.get) == max(local, key=local.get), text
        diffs.append(max(abs(imported[t] - local[t]) for t in shared))
        pd = tokens_of(asyncio.run(pd_request(cluster[prefiller].url, cluster["sglang2"].url, ids, sampling)))
        alone = tokens_of(asyncio.run(generate_request(cluster["sglang2"].url, ids, sampling)))
        agree += pd == alone
    figures = {
        "direction": f"{prefiller}->sglang",
        "prompts": len(PROMPTS),
        "greedy_agreement": agree,
        "logprob_max_abs_diff_max": max(diffs),
        "logprob_max_abs_diff_median": float(np.median(diffs)),
        "compared": "top-20 log-probabilities of SGLang's first decode step",
        "tolerance": LOGIT_TOLERANCE,
    }
    write_report(f"cross_engine_{prefiller}_to_sglang", figures)
    assert max(diffs) <= LOGIT_TOLERANCE, figures
    assert agree >= MIN_AGREEMENT, figures


def test_sglang_decodes_commit_first_only(cluster, long_ids):
    """SGLang continues from the prefiller's first token and never recomputes a prompt token."""
    with cluster["sglang2"].client() as c:
        info = c.get("/v1/info").json()
        assert info["decoder_modes"] == ["commit-first"] and info["engine"] == "sglang"
        r = c.post(
            "/v1/decode",
            json={
                "room": uuid.uuid4().hex,
                "token_ids": prompt(long_ids, 70),
                "mode": "recompute-last",
                "prefill_url": cluster["torch"].url,
            },
        )
        assert r.status_code == 400 and "cannot decode in recompute-last mode" in r.json()["error"]["message"]


def test_sglang_pages_leave_while_it_still_prefills(cluster, long_ids):
    """SGLang prefills in chunks (--chunked-prefill-size 512): a 1,500-token prompt's first pages
    reach the decoder before SGLang has finished the prompt."""
    ids = (list(long_ids) * 8)[:1500]
    done = asyncio.run(pd_request(cluster["sglang"].url, cluster["torch"].url, ids, {"max_tokens": 2}))[-1]
    assert done.get("done"), done
    assert done["first_page_at"] < done["prefill_finished_at"] - 0.05, done
    write_report(
        "sglang_overlap",
        {k: done[k] for k in ("first_page_at", "last_page_at", "prefill_finished_at", "prefill_seconds", "pages")},
    )


def test_a_decoder_that_cannot_continue_fails_cleanly(cluster, long_ids, smol_dir, tmp_path):
    """Into SGLang's decode role: a flipped bit in page 1 (after page 0 is already in SGLang's
    slots), a stream cut short (missing pages) and pages of another model contract each end
    with their own error; SGLang's token pool and both agents return to baseline."""
    t, s = cluster["torch"], cluster["sglang2"]
    ids = prompt(long_ids, 150)
    errors = {}
    for name, damage, expect in (
        ("flipped_bit", dict(flip_at=1_800_000), "checksum mismatch on page 1"),
        ("missing_pages", dict(cut_at=1_700_000), "broke off"),
    ):
        proxy = TamperProxy(t.port, **damage)
        try:
            lines = run(pd_request(t.url, s.url, ids, {"max_tokens": 4}, prefill_url=proxy.url))
        finally:
            proxy.close()
        assert "error" in lines[-1] and expect in lines[-1]["error"]["message"], lines[-1]
        assert not any("token" in x for x in lines)
        errors[name] = lines[-1]["error"]["message"]
        at_baseline(t, s)
    with AgentProcess("torch", smol_dir, tmp_path / "other", "--context-length", "4096") as other:
        lines = run(decode_foreign_pages(other.url, s.url, ids))
        assert lines[-1]["error"]["type"] == "ContractMismatch", lines[-1]
        errors["wrong_contract"] = lines[-1]["error"]["message"]
        at_baseline(other, s)
    write_report("sglang_decoder_failures", errors)


def test_broken_page_streams_inside_the_adapter_release_sglangs_slots(sglang_engine, engines, long_ids):
    """The adapter's own checks on a stream handed to SGLang's decode role: a missing page, pages
    out of order and a page of the wrong shape; each fails and SGLang frees the slots it held."""
    ids = prompt(long_ids, 200)
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
            run(collect(sglang_engine.decode(EngineRequest(name, ids, SamplingParams(max_tokens=4)), feed())))
        deadline = time.monotonic() + 20
        while run(sglang_engine.engine_stats())["kv_tokens_used"]:
            assert time.monotonic() < deadline, run(sglang_engine.engine_stats())
            time.sleep(0.1)
        assert sglang_engine.active_requests == 0


def _decode_lines(d: AgentProcess, p: AgentProcess, ids: list[int], room: str) -> list[dict]:
    return asyncio.run(pd_request(p.url, d.url, ids, {"max_tokens": 64, "ignore_eos": True}, room=room))


def test_cancel_and_peer_kill_return_sglang_to_baseline(cluster, long_ids, smol_dir, tmp_path):
    """Mid-transfer, with SGLang on either side: the handoff cancelled, the prefiller killed, the
    decoder killed. Each ends with its own error; SGLang's token pool and the agents' budgets
    return to baseline, and SGLang still serves."""
    s, s2, t = cluster["sglang"], cluster["sglang2"], cluster["torch"]
    ids = (list(long_ids) * 8)[:1500]  # several prefill chunks: time to act mid-stream
    figures = {}

    async def cancel_mid_transfer(p: AgentProcess, d: AgentProcess):
        room = uuid.uuid4().hex
        task = asyncio.create_task(asyncio.to_thread(_decode_lines, d, p, ids, room))
        await asyncio.to_thread(wait_until_streaming, p)
        client = AgentClient(p.url, TEST_KEY)
        await client.cancel_handoff(room)
        await client.aclose()
        return await task

    for label, p, d in (("cancel_torch_to_sglang", t, s2), ("cancel_sglang_to_torch", s, t)):
        lines = asyncio.run(cancel_mid_transfer(p, d))
        assert "error" in lines[-1] and "cancelled" in lines[-1]["error"]["message"], lines[-1]
        at_baseline(p, d)
        figures[label] = lines[-1]["error"]["message"][:300]

    # the prefiller dies mid-transfer into SGLang's decode role
    with AgentProcess("torch", smol_dir, tmp_path / "doomed-p") as doomed:

        async def kill_prefiller():
            task = asyncio.create_task(asyncio.to_thread(_decode_lines, s2, doomed, ids, uuid.uuid4().hex))
            await asyncio.to_thread(wait_until_streaming, doomed)
            doomed.proc.kill()
            return await task

        lines = asyncio.run(kill_prefiller())
    assert "error" in lines[-1] and "broke off" in lines[-1]["error"]["message"], lines[-1]
    at_baseline(s2)
    figures["prefiller_killed"] = lines[-1]["error"]["message"][:300]

    # the decoder dies while SGLang's prefill role streams to it
    with AgentProcess("torch", smol_dir, tmp_path / "doomed-d") as doomed:

        async def kill_decoder():
            task = asyncio.create_task(asyncio.to_thread(_decode_lines, doomed, s, ids, uuid.uuid4().hex))
            await asyncio.to_thread(wait_until_streaming, s)
            doomed.proc.kill()
            try:
                await task
            except Exception as e:  # the decoder's answer breaks off with it
                return repr(e)
            return "decoder gone"

        figures["decoder_killed"] = asyncio.run(kill_decoder())
    at_baseline(s)
    figures["kv_tokens_used_after"] = {"sglang": pool_used(s), "sglang2": pool_used(s2)}
    for pair in ("t2s", "s2t"):
        assert (
            "Paris"
            in cluster["client"]
            .chat.completions.create(model=pair, messages=QUESTION, max_tokens=20, temperature=0)
            .choices[0]
            .message.content
        )
    write_report("sglang_faults", figures)


def test_damaged_page_streams_fall_back_through_the_panel(cluster, long_ids):
    """A bit flipped in a page, a stream cut short, then a link gone silent mid-stream, between
    two SGLang agents through the panel: the decoder-alone answer each time, the reason logged, and both SGLang pools idle."""
    seen = check_damaged_streams_through_panel(
        cluster,
        "sglang",
        "sglang2",
        prompt(long_ids, 130),
        {name: {"kv_tokens_used": 0} for name in ("sglang", "sglang2")},
    )
    write_report("sglang_damaged_streams", seen)


def test_a_slow_link_between_sglangs_holds_memory_flat(cluster):
    """16 pages between the two SGLang agents through a link held to 4 MB/s, through the panel."""
    idle = {name: {"kv_tokens_used": 0} for name in ("sglang", "sglang2")}
    write_report(
        "sglang_slow_link",
        check_slow_link_through_panel(cluster, "sglang", "sglang2", prompt_ids(1000, 5, VOCAB), idle),
    )


def test_a_short_soak_through_sglang_pairs_leaves_nothing_behind(cluster):
    idle = {name: {"kv_tokens_used": 0} for name in ("sglang", "sglang2")}
    write_report("sglang_soak", check_soak_through_panel(cluster, ["s2s", "t2s"], ("sglang", "sglang2", "torch"), idle))


def test_a_peer_of_sglang_killed_mid_stream_through_the_panel(cluster, smol_dir, long_ids, tmp_path):
    """A torch prefiller of SGLang's decode role, and a torch decoder of its prefill role."""
    ids = (list(long_ids) * 8)[:1500]  # six prefill chunks on the torch prefiller: time to act mid-stream
    idle = {name: {"kv_tokens_used": 0} for name in ("sglang", "sglang2")}
    write_report(
        "sglang_peer_kills", check_peer_kills_through_panel(cluster, "sglang2", "sglang", smol_dir, tmp_path, ids, idle)
    )


def test_panel_restarted_while_an_sglang_pair_streams(cluster):
    idle = {name: {"kv_tokens_used": 0} for name in ("sglang", "sglang2")}
    write_report(
        "sglang_panel_restart",
        check_panel_restart(cluster, "s2s", "sglang", "sglang2", prompt_ids(200, 7, VOCAB), idle),
    )


def test_schemathesis_on_the_agent_routes_that_reach_sglang(cluster):
    """Fuzzed requests (tests/fuzzing.py) to SGLang's decode role whose prefiller is SGLang's
    prefill role: no 5xx, no hang, every refusal a clear error; afterwards both are idle."""
    counts = fuzz_engine_routes(cluster["sglang2"], cluster["sglang"])
    at_engine_baseline(cluster, ("sglang", "sglang2"), {name: {"kv_tokens_used": 0} for name in ("sglang", "sglang2")})
    assert (
        "Paris"
        in cluster["client"]
        .chat.completions.create(model="s2s", messages=QUESTION, max_tokens=20, temperature=0)
        .choices[0]
        .message.content
    )
    write_report("sglang_schemathesis", counts)


def test_64_concurrent_streams_between_sglangs_complete_or_get_429(cluster, smol_dir):
    idle = {name: {"kv_tokens_used": 0} for name in ("sglang", "sglang2")}
    write_report("sglang_load", check_load_through_panel(cluster, "s2s", "sglang", "sglang2", smol_dir, idle))


def test_a_crashed_sglang_is_restarted(cluster, long_ids):
    """SGLang's engine server killed while it prefills a request through the panel: the request
    is answered by the decoder alone, and the agent brings SGLang back."""
    check_engine_crash_through_panel(cluster, "s2m", "sglang", "mlx", "kv_tokens_used", long_ids)
    text = (
        cluster["client"]
        .chat.completions.create(model="s2s", messages=QUESTION, max_tokens=20, temperature=0)
        .choices[0]
        .message.content
    )
    assert "Paris" in text

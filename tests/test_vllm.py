"""Real vLLM (the CPU build, in .venv-vllm) as prefiller and decoder, through agents and the panel.

Two vLLM agents, a torch agent and an MLX agent run as separate processes; the panel exposes every
pair with vLLM on one side. Figures go to reports/vllm_*.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import numpy as np
import pytest

from engine_adapters.base import EngineRequest
from engine_adapters.settings import EngineSettings
from engine_adapters.vllm_adapter import vllm_python
from tandem_cli.bench_ttft import prompt_ids
from tandem_protocol.client import AgentClient
from tandem_protocol.handoff import FirstTokenMode
from tandem_protocol.pages import KVPage
from tandem_protocol.sampling import SamplingParams

from .agents import TEST_KEY, AgentProcess, generate_request, pd_request, settle, wait_until_streaming
from .conftest import collect, prompt, run, write_report
from .engine_probes import vllm_first_step_logprobs
from .fuzzing import VOCAB, fuzz_engine_routes
from .server_engines import (
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
    "v2m": ("vllm", "mlx"),
    "m2v": ("mlx", "vllm"),
    "v2t": ("vllm", "torch"),
    "t2v": ("torch", "vllm"),
    "v2v": ("vllm", "vllm2"),
}


@pytest.fixture(scope="module")
def cluster(smol_dir, tmp_path_factory):
    try:
        vllm_python(EngineSettings())
    except Exception as e:
        pytest.fail(f"vLLM is part of `make test`: {e}")
    home = tmp_path_factory.mktemp("vllm")
    os.environ.setdefault("TANDEM_VLLM_THREADS", "1")  # equal thread counts: outputs comparable bit for bit
    agents = {name: ("vllm" if name.startswith("vllm") else name, {}) for name in ("vllm", "vllm2", "torch", "mlx")}
    # "crash" is only for the engine-crash test (check_every_direction covers PAIRS)
    with engine_cluster(
        smol_dir, home, agents, {**PAIRS, "crash": ("vllm2", "mlx")}, tampered=("vllm", "vllm2")
    ) as cluster:
        yield cluster


def kv_usage(agent: AgentProcess) -> float:
    return agent.status()["engine_stats"]["kv_cache_usage"]


def test_vllm_pages_equal_transformers_reference(cluster, engines, long_ids):
    """Page bytes from vLLM's cache against the K/V transformers computes for the same prompt."""
    check_pages_against_transformers(cluster["vllm"], engines["torch"], long_ids, "vllm_pages")
    settle(cluster["vllm"])


def test_every_direction_through_the_panel(cluster, long_ids):
    check_every_direction(cluster, PAIRS, "v2v", long_ids, "vllm_directions")
    assert kv_usage(cluster["vllm"]) == 0 and kv_usage(cluster["vllm2"]) == 0


async def _decode_lines(d: AgentProcess, p: AgentProcess, ids: list[int], room: str) -> list[dict]:
    return await pd_request(p.url, d.url, ids, {"max_tokens": 64, "ignore_eos": True}, room=room)


def test_cancel_and_peer_kill_return_vllm_to_baseline(cluster, long_ids, smol_dir, tmp_path):
    v, t = cluster["vllm"], cluster["torch"]
    ids = (list(long_ids) * 8)[:1500]  # 6 prefill chunks on the torch prefiller: time to act mid-stream
    baseline = kv_usage(v)

    async def cancel_mid_transfer():
        room = uuid.uuid4().hex
        task = asyncio.create_task(_decode_lines(v, t, ids, room))
        await asyncio.to_thread(wait_until_streaming, t)
        client = AgentClient(t.url, TEST_KEY)
        await client.cancel_handoff(room)
        await client.aclose()
        return await task

    cancelled = asyncio.run(cancel_mid_transfer())
    assert "error" in cancelled[-1] and "cancelled" in cancelled[-1]["error"]["message"], cancelled[-1]
    settle(v, t)
    assert kv_usage(v) == baseline == 0

    # the prefiller dies mid-transfer: a torch agent of its own, killed while it streams
    with AgentProcess("torch", smol_dir, tmp_path / "doomed") as doomed:

        async def kill_mid_transfer():
            task = asyncio.create_task(_decode_lines(v, doomed, ids, uuid.uuid4().hex))
            await asyncio.to_thread(wait_until_streaming, doomed)
            doomed.proc.kill()
            return await task

        killed = asyncio.run(kill_mid_transfer())
    assert "error" in killed[-1] and "broke off" in killed[-1]["error"]["message"], killed[-1]
    settle(v)
    assert kv_usage(v) == baseline

    # the decoder dies while vLLM prefills for it: vLLM lets go of the request's blocks
    with AgentProcess("torch", smol_dir, tmp_path / "doomed-d") as doomed:

        async def kill_decoder():
            task = asyncio.create_task(_decode_lines(doomed, v, ids, uuid.uuid4().hex))
            await asyncio.to_thread(wait_until_streaming, v)
            doomed.proc.kill()
            try:
                return repr((await task)[-1])
            except Exception as e:  # the decoder's answer breaks off with it
                return repr(e)

        decoder_killed = asyncio.run(kill_decoder())
    at_engine_baseline(cluster, ("vllm",), {"vllm": {"kv_cache_usage": baseline}})  # vLLM frees on its own schedule
    # and vLLM still serves
    assert (
        "Paris"
        in cluster["client"]
        .chat.completions.create(
            model="t2v",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
        )
        .choices[0]
        .message.content
    )
    write_report(
        "vllm_faults",
        {
            "cancel_mid_transfer": cancelled[-1]["error"]["message"][:300],
            "prefiller_killed_mid_transfer": killed[-1]["error"]["message"][:300],
            "decoder_killed_mid_transfer": decoder_killed[:300],
            "kv_cache_usage_after": kv_usage(v),
        },
    )


def test_damaged_page_streams_fall_back_through_the_panel(cluster, long_ids):
    """A bit flipped in a page, a stream cut short, then a link gone silent mid-stream, between
    two vLLM agents through the panel: the decoder-alone answer each time, the reason logged, and both vLLM pools idle."""
    seen = check_damaged_streams_through_panel(
        cluster, "vllm", "vllm2", prompt(long_ids, 130), {name: {"kv_cache_usage": 0.0} for name in ("vllm", "vllm2")}
    )
    write_report("vllm_damaged_streams", seen)


def test_a_slow_link_between_vllms_holds_memory_flat(cluster):
    """16 pages between the two vLLM agents through a link held to 4 MB/s, through the panel."""
    idle = {name: {"kv_cache_usage": 0.0} for name in ("vllm", "vllm2")}
    write_report(
        "vllm_slow_link", check_slow_link_through_panel(cluster, "vllm", "vllm2", prompt_ids(1000, 5, VOCAB), idle)
    )


def test_panel_restarted_while_a_vllm_pair_streams(cluster):
    idle = {name: {"kv_cache_usage": 0.0} for name in ("vllm", "vllm2")}
    write_report(
        "vllm_panel_restart", check_panel_restart(cluster, "v2v", "vllm", "vllm2", prompt_ids(200, 7, VOCAB), idle)
    )


def test_schemathesis_on_the_agent_routes_that_reach_vllm(cluster):
    """Fuzzed requests (tests/fuzzing.py) to a vLLM decoder whose prefiller is the other vLLM:
    no 5xx, no hang, every refusal a clear error; afterwards both are idle and vLLM serves."""
    counts = fuzz_engine_routes(cluster["vllm2"], cluster["vllm"])
    at_engine_baseline(cluster, ("vllm", "vllm2"), {name: {"kv_cache_usage": 0.0} for name in ("vllm", "vllm2")})
    assert (
        "Paris"
        in cluster["client"]
        .chat.completions.create(
            model="v2v",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
        )
        .choices[0]
        .message.content
    )
    write_report("vllm_schemathesis", counts)


def test_64_concurrent_streams_between_vllms_complete_or_get_429(cluster, smol_dir):
    idle = {name: {"kv_cache_usage": 0.0} for name in ("vllm", "vllm2")}
    write_report("vllm_load", check_load_through_panel(cluster, "v2v", "vllm", "vllm2", smol_dir, idle))


def test_a_short_soak_through_vllm_pairs_leaves_nothing_behind(cluster):
    idle = {name: {"kv_cache_usage": 0.0} for name in ("vllm", "vllm2")}
    write_report("vllm_soak", check_soak_through_panel(cluster, ["v2v", "t2v"], ("vllm", "vllm2", "torch"), idle))


def test_a_peer_of_vllm_killed_mid_stream_through_the_panel(cluster, smol_dir, long_ids, tmp_path):
    ids = (list(long_ids) * 8)[:1500]  # six prefill chunks on the torch prefiller: time to act mid-stream
    write_report(
        "vllm_peer_kills",
        check_peer_kills_through_panel(
            cluster, "vllm", "vllm", smol_dir, tmp_path, ids, {"vllm": {"kv_cache_usage": 0.0}}
        ),
    )


def test_a_crashed_vllm_is_restarted(cluster, long_ids):
    """vLLM's engine server killed while it prefills a request through the panel: the request
    is answered by the decoder alone, and the agent brings vLLM back."""
    check_engine_crash_through_panel(cluster, "crash", "vllm2", "mlx", "kv_cache_usage", long_ids)
    text = (
        cluster["client"]
        .chat.completions.create(
            model="v2v",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
        )
        .choices[0]
        .message.content
    )
    assert "Paris" in text


def test_vllm_refuses_commit_first_decoding(cluster, long_ids):
    """vLLM always computes the last prompt token itself: it decodes in recompute-last mode only."""
    with cluster["vllm"].client() as c:
        info = c.get("/v1/info").json()
        assert info["decoder_modes"] == ["recompute-last"] and info["engine"] == "vllm"
        r = c.post(
            "/v1/decode",
            json={
                "room": uuid.uuid4().hex,
                "token_ids": prompt(long_ids, 70),
                "mode": "commit-first",
                "prefill_url": cluster["torch"].url,
            },
        )
        assert r.status_code == 400 and "cannot decode in commit-first mode" in r.json()["error"]["message"]


def test_gpu_layouts_with_vllms_own_views():
    """The connector's GPU layout code on caches built by vLLM's own view functions, for every
    KVCacheLayout vLLM defines (run in vLLM's interpreter: vLLM lives in its own environment)."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).with_name("vllm_layouts_check.py")
    out = subprocess.run([str(vllm_python(EngineSettings())), str(script)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results) >= 6 and all(all(r.values()) for r in results.values()), results
    write_report("vllm_gpu_layouts", results)


def test_vllm_pages_leave_while_it_still_prefills(cluster, long_ids):
    """vLLM prefills in chunks (--max-num-batched-tokens 512): a 1,500-token prompt's first pages
    reach the decoder before vLLM has finished the prompt."""

    ids = (list(long_ids) * 8)[:1500]
    done = asyncio.run(pd_request(cluster["vllm"].url, cluster["torch"].url, ids, {"max_tokens": 2}))[-1]
    assert done.get("done"), done
    # (in one step, every page would leave together, within milliseconds of the last)
    assert done["first_page_at"] < done["prefill_finished_at"] - 0.05, done
    write_report(
        "vllm_overlap",
        {k: done[k] for k in ("first_page_at", "last_page_at", "prefill_finished_at", "prefill_seconds", "pages")},
    )


# The statistical rules run on the headline directions, vLLM <-> MLX (20 prompts, 32 greedy tokens
# each, ~2.5 min per direction on two cores); vLLM <-> torch is held to greedy agreement with the
# decoder alone at every page-boundary length by test_every_direction_through_the_panel.
@pytest.mark.parametrize("decoder", ["mlx"])
def test_vllm_prefill_meets_the_cross_engine_rules(cluster, engines, decoder):
    """The core issue's rules for vLLM -> torch and vLLM -> MLX over its 20 chat prompts."""
    check_prefiller_rules(cluster["vllm"], cluster[decoder], engines[decoder], f"vllm->{decoder}")


@pytest.mark.parametrize("prefiller", ["mlx"])
def test_vllm_decoder_meets_the_cross_engine_rules(cluster, engines, prefiller, vllm_engine):
    """X -> vLLM under the core issue's rules, over its 20 chat prompts: vLLM's first-step
    log-probabilities (its API exposes those, not logits) after importing X's pages of prompt[:-1]
    against vLLM's own, and greedy agreement of the P/D output with vLLM alone."""
    from .test_cross_engine import LOGIT_TOLERANCE, MIN_AGREEMENT, PROMPTS

    p = engines[prefiller]
    sampling = {"max_tokens": 32, "ignore_eos": True}
    diffs, agree = [], 0
    for i, text in enumerate(PROMPTS):
        ids = p.chat_token_ids([{"role": "user", "content": text}])
        req = EngineRequest(f"lp-{i}", ids, SamplingParams(max_tokens=1), FirstTokenMode.RECOMPUTE_LAST)
        pages = [x for x in run(collect(p.prefill(req))) if isinstance(x, KVPage)]
        imported = run(vllm_first_step_logprobs(vllm_engine, ids, pages))
        local = run(vllm_first_step_logprobs(vllm_engine, ids))
        shared = set(imported) & set(local)
        assert max(imported, key=imported.get) == max(local, key=local.get), text
        diffs.append(max(abs(imported[t] - local[t]) for t in shared))
        pd = [
            x["token"]
            for x in asyncio.run(pd_request(cluster[prefiller].url, cluster["vllm"].url, ids, sampling))
            if "token" in x
        ]
        alone = [x["token"] for x in asyncio.run(generate_request(cluster["vllm"].url, ids, sampling)) if "token" in x]
        agree += pd == alone
    figures = {
        "direction": f"{prefiller}->vllm",
        "prompts": len(PROMPTS),
        "greedy_agreement": agree,
        "logprob_max_abs_diff_max": max(diffs),
        "logprob_max_abs_diff_median": float(np.median(diffs)),
        "compared": "top-20 log-probabilities of the first decode step",
        "tolerance": LOGIT_TOLERANCE,
    }
    write_report(f"cross_engine_{prefiller}_to_vllm", figures)
    assert max(diffs) <= LOGIT_TOLERANCE, figures
    assert agree >= MIN_AGREEMENT, figures


@pytest.fixture(scope="module")
def vllm_engine(smol_dir):
    """vLLM driven from this process through its adapter, for its log-probabilities."""
    from engine_adapters import load_adapter

    adapter = load_adapter("vllm", smol_dir)
    yield adapter
    adapter.close()

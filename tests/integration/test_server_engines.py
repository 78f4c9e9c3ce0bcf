"""What only the engines that run as their own servers (vLLM, SGLang) have: their pages against
transformers' K/V, the decoder mode each refuses, pages leaving while they still prefill, fuzzed
agent routes reaching them, vLLM's GPU layouts, SGLang's sampling refusals and its adapter's own
stream checks. Figures go to reports/*.json."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from engine_adapters.settings import EngineSettings
from engine_adapters.vllm_adapter import vllm_python

from ..agents import pd_request
from ..conftest import prompt, write_report
from ..fuzzing import fuzz_engine_routes
from ..server_engines import check_pages_against_transformers

SERVERS = ["vllm", "sglang"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize("engine", SERVERS)
def test_pages_equal_transformers_reference(cluster, engines, long_ids, engine):
    check_pages_against_transformers(cluster[engine], engines["torch"], long_ids, f"{engine}_pages")
    cluster.idle(engine)


@pytest.mark.parametrize(
    "decoder, mode, other",
    [("vllm", "commit-first", "recompute-last"), ("sglang2", "recompute-last", "commit-first")],
    ids=["vllm", "sglang"],
)
def test_a_server_decoder_refuses_the_mode_it_cannot_decode(cluster, long_ids, decoder, mode, other):
    """vLLM always computes the last prompt token itself (recompute-last only); SGLang continues
    from the prefiller's first token and never recomputes a prompt token (commit-first only)."""
    with cluster[decoder].client() as c:
        assert c.get("/v1/info").json()["decoder_modes"] == [other]
        body = {"token_ids": prompt(long_ids, 70), "mode": mode}
        r = c.post("/v1/decode", json={**body, "prefill_url": cluster["torch"].url})
        assert r.status_code == 400 and f"cannot decode in {mode} mode" in r.json()["error"]["message"]


@pytest.mark.parametrize("engine", SERVERS)
def test_pages_leave_while_the_server_still_prefills(cluster, long_ids, engine):
    """The servers prefill in chunks of 512 tokens: a 640-token prompt's (two chunks) first pages
    reach the decoder before the server has finished the prompt (in one step they would leave
    together). (Was 1,500 tokens: three chunks, for a property two show.)"""
    ids = (list(long_ids) * 8)[:640]
    done = asyncio.run(pd_request(cluster[engine].url, cluster["torch"].url, ids, {"max_tokens": 2}))[-1]
    assert done.get("done"), done
    assert done["first_page_at"] < done["prefill_finished_at"] - 0.05, done
    keys = ("first_page_at", "last_page_at", "prefill_finished_at", "prefill_seconds", "pages")
    write_report(f"{engine}_overlap", {k: done[k] for k in keys})
    cluster.idle(engine, "torch")


@pytest.mark.parametrize("d, p", [("vllm2", "vllm"), ("sglang2", "sglang")], ids=SERVERS)
def test_schemathesis_on_the_agent_routes_that_reach_the_server(cluster, d, p):
    """Fuzzed requests (tests/fuzzing.py) to a server decoder whose prefiller is the same engine:
    no 5xx, no hang, every refusal a clear error; afterwards both are idle and the pair serves."""
    counts = fuzz_engine_routes(cluster[d], cluster[p])
    cluster.idle(p, d)
    answer = cluster.client.chat.completions.create(
        model=f"{p}-to-{d}", messages=QUESTION, max_tokens=20, temperature=0
    )
    assert "Paris" in answer.choices[0].message.content
    write_report(f"{p}_schemathesis", counts)


def test_gpu_layouts_with_vllms_own_views():
    """The connector's GPU layout code on caches built by vLLM's own view functions, for every
    KVCacheLayout vLLM defines (run in vLLM's interpreter: vLLM lives in its own environment)."""
    script = Path(__file__).resolve().parent.parent / "vllm_layouts_check.py"
    out = subprocess.run([str(vllm_python(EngineSettings())), str(script)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results) >= 6 and all(all(r.values()) for r in results.values()), results
    write_report("vllm_gpu_layouts", results)


def test_sampling_a_prefiller_cannot_honour_is_refused_before_anything_runs(cluster):
    """MLX samples the first token of MLX -> SGLang but has no min_p or repetition penalty: the
    panel answers 400 before either role is scheduled. The same parameters are honoured where
    both engines can (SGLang -> SGLang), and an MLX decoder refuses them too."""
    client, mlx, sg = cluster.client, cluster["mlx"], cluster["sglang2"]
    before = (mlx.status()["totals"], sg.status()["totals"])
    for model, extra in (
        ("mlx-to-sglang2", {"min_p": 0.05}),
        ("mlx-to-sglang2", {"repetition_penalty": 1.2}),
        ("sglang-to-mlx", {"min_p": 0.05}),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, extra_body=extra)
        message = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
        assert "mlx" in message and next(iter(extra)) in message, message
    assert (mlx.status()["totals"], sg.status()["totals"]) == before  # nothing prefilled, nothing decoded
    extra = {"min_p": 0.05, "repetition_penalty": 1.1}
    answer = client.chat.completions.create(
        model="sglang-to-sglang2", messages=QUESTION, max_tokens=20, temperature=0, extra_body=extra
    )
    assert "Paris" in answer.choices[0].message.content


@pytest.mark.parametrize("name, path", [("vllm", "/v1/completions"), ("sglang2", "/generate")])
def test_the_engine_servers_answer_their_agent_alone(cluster, name, path):
    """Issue 22: vLLM's and SGLang's servers listen on loopback, where any local user or web page
    reaches them: without the key their agent made for them they refuse a request; the key is in
    neither their command line (which `ps` shows every user) nor, with the cluster key, anywhere in
    their environment."""
    agent = cluster[name]
    pid = agent.status()["engine_stats"]["pid"]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    port = int(argv[argv.index(b"--port") + 1])
    assert b"--api-key" not in argv and b"--load-format" in argv, argv
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    assert agent.key.encode() not in environ and b"TANDEM_CLUSTER_KEY" not in environ
    body = (
        {"prompt": "Hi", "max_tokens": 1}
        if name == "vllm"
        else {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}
    )
    for headers in ({}, {"Authorization": f"Bearer {agent.key}"}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"http://127.0.0.1:{port}{path}", json={"model": "tandem", **body}, headers=headers, timeout=30)
        assert r.status_code in (401, 403), (headers, r.status_code, r.text[:200])
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200  # what the agent polls

"""A panel configures a node: model paths are confined and checked before anything loads; the
engine, model, context length and budget switch on a real agent process; a busy node refuses."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid

import pytest

from tests.agents import AgentProcess, pd_request, settle, tokens_of
from tests.conftest import make_tiny_checkpoint

SAMPLING = {"max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def root(tmp_path_factory, smol_dir):
    """A model root holding the embedded model (linked), a tiny Qwen3 and an unsupported checkpoint."""
    r = tmp_path_factory.mktemp("models")
    (r / "smollm2").symlink_to(smol_dir, target_is_directory=True)
    make_tiny_checkpoint(r / "tiny-qwen3", "qwen3", smol_dir)
    bad = r / "gemma-ish"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gemma3", "vocab_size": 10}))
    outside = tmp_path_factory.mktemp("elsewhere") / "model"
    shutil.copytree(r / "tiny-qwen3", outside)
    return r, outside


@pytest.fixture(scope="module")
def agent(root, smol_dir, tmp_path_factory):
    r, _ = root
    with AgentProcess("torch", r / "smollm2", tmp_path_factory.mktemp("home"), "--model-root", str(r)) as a:
        yield a


def configure(agent: AgentProcess, **body) -> tuple[int, dict]:
    with agent.client() as c:
        resp = c.post("/v1/config", json=body, timeout=300)
        return resp.status_code, resp.json()


def test_paths_are_checked_before_anything_loads(agent, root):
    r, outside = root
    cases = [
        (dict(engine="torch", model_path=str(outside)), "model_path", "outside this node's model roots"),
        (
            dict(engine="torch", model_path=str(r / "tiny-qwen3" / ".." / ".." / outside.parent.name / "model")),
            "model_path",
            "outside this node's model roots",
        ),
        (dict(engine="torch", model_path=str(r / "missing")), "model_path", "does not exist"),
        (dict(engine="torch", model_path="tiny-qwen3"), "model_path", "must be absolute"),
        (dict(engine="torch", model_path=str(r / "gemma-ish")), "model_path", "gemma3"),
        (dict(engine="vllm-ish", model_path=str(r / "tiny-qwen3")), "engine", "unknown engine"),
        (dict(engine="torch", model_path=str(r / "tiny-qwen3"), context_length=10**7), "context_length", "outside 1.."),
    ]
    before = agent.status()
    for body, field, message in cases:
        status, out = configure(agent, **body)
        assert status == 400 and out["error"]["field"] == field and message in out["error"]["message"], (body, out)
    (r / "escape").symlink_to(outside, target_is_directory=True)  # a link out of the root is outside too
    status, out = configure(agent, engine="torch", model_path=str(r / "escape"))
    assert status == 400 and "outside" in out["error"]["message"]
    assert agent.status()["contract"] == before["contract"]  # nothing was loaded
    status, out = configure(agent, engine="mlx", model_path=str(r / "tiny-qwen3"), dry_run=True)
    assert status == 200 and out["ok"] and not out["changed"] and out["max_context"] == 512


def test_local_models_lists_the_roots(agent, root):
    r, _ = root
    with agent.client() as c:
        listed = {m["path"]: m for m in c.get("/v1/models/local").json()["models"]}
    assert listed[str((r / "tiny-qwen3").resolve())]["supported"]
    assert not listed[str(r / "gemma-ish")]["supported"] and "gemma3" in listed[str(r / "gemma-ish")]["reason"]


def test_switch_engine_model_context_and_budget(agent, root, long_ids):
    r, _ = root
    start = agent.status()
    # same engine and model: nothing reloads
    status, out = configure(agent, engine="torch", model_path=str(r / "smollm2"))
    assert status == 200 and not out["changed"]
    # another model: the contract follows it, and a dry run foretold it without loading anything
    _, foretold = configure(agent, engine="torch", model_path=str(r / "tiny-qwen3"), dry_run=True)
    assert agent.status()["contract"] == start["contract"]
    status, out = configure(agent, engine="torch", model_path=str(r / "tiny-qwen3"))
    assert status == 200 and out["changed"] and out["model"] == "tiny-qwen3"
    assert out["contract"] == foretold["contract"]
    assert out["contract"]["fingerprint"] != start["contract"]["fingerprint"]
    # another engine on the first model, a shorter context and a new budget
    status, out = configure(
        agent, engine="mlx", model_path=str(r / "smollm2"), context_length=1024, staging_bytes=64 << 20
    )
    assert status == 200 and out["engine"] == "mlx" and out["context_length"] == 1024
    s = agent.status()
    assert s["engine"] == "mlx" and s["budget"]["capacity"] == 64 << 20
    assert s["contract"]["fingerprint"] != start["contract"]["fingerprint"]  # context length is in the contract
    # it serves: P/D from itself to itself equals its own generate
    ids = list(long_ids[:130])
    pd = tokens_of(asyncio.run(pd_request(agent.url, agent.url, ids, SAMPLING)))
    with agent.client() as c:
        alone = [
            json.loads(line)
            for line in c.post("/v1/generate", json={"token_ids": ids, "sampling": SAMPLING}).text.splitlines()
        ]
    assert pd == tokens_of(alone)
    settle(agent)
    # back to where it started
    status, out = configure(
        agent,
        engine="torch",
        model_path=str(r / "smollm2"),
        context_length=start["context_length"],
        staging_bytes=start["budget"]["capacity"],
    )
    assert status == 200 and out["contract"]["fingerprint"] == start["contract"]["fingerprint"]


def test_a_busy_node_refuses_to_switch(agent, root, long_ids):
    r, _ = root
    with agent.client() as c:
        info = c.get("/v1/info").json()
        handoff_id = uuid.uuid4().hex
        made = c.post(
            "/v1/handoffs",
            json={
                "handoff_id": handoff_id,
                "token_ids": list(long_ids[:70]),
                "contract": info["contract"]["fingerprint"],
            },
        )
        assert made.status_code == 201
        status, out = configure(agent, engine="mlx", model_path=str(r / "smollm2"))
        assert status == 409 and "in flight" in out["error"]["message"]
        c.delete(f"/v1/handoffs/{handoff_id}")
    settle(agent)
    assert agent.status()["engine"] == "torch"

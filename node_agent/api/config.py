"""A node's configuration from a panel: POST /v1/config (engine, model, context length, staging
budget) and the checkpoints it may load (GET /v1/models/local)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from engine_adapters import ADAPTERS
from tandem_protocol.api import ConfigBody
from tandem_protocol.contract import HashCache, compute_contract
from tandem_protocol.model_dir import ModelInfo
from tandem_protocol.settings import hash_cache_path

from ..deps import KEYED, Agent, Config
from ..errors import ConfigError
from ..model_roots import ModelPathError, check_model, list_models
from ..state import AgentState

router = APIRouter(dependencies=KEYED)


@router.get("/v1/models/local")
async def local_models(config: Config):
    """Checkpoints in this node's model roots, for a panel's model picker."""
    return {
        "roots": [str(r) for r in config.model_roots],
        "models": await asyncio.to_thread(list_models, config.model_roots),
    }


async def checked_model(body: ConfigBody, agent: AgentState) -> tuple[ModelInfo, int]:
    """The model the body names, inside this node's roots, and the context length to load it with."""
    if body.engine not in ADAPTERS:
        raise ConfigError(f"unknown engine {body.engine!r} (known: {', '.join(ADAPTERS)})", "engine")
    try:
        model = await asyncio.to_thread(check_model, body.model_path, agent.config.model_roots)
    except ModelPathError as e:
        raise ConfigError(str(e), "model_path") from None
    if body.context_length is not None and not 1 <= body.context_length <= model.max_context:
        raise ConfigError(
            f"context length {body.context_length} is outside 1..{model.max_context} for {model.path.name}",
            "context_length",
        )
    return model, body.context_length or model.max_context  # blank: the model's own


async def announce(agent: AgentState) -> None:
    """Tell the LAN (mDNS) what this node serves now."""
    if agent.discovery is None:
        return
    a = agent.slot.adapter
    accel = a.accelerator()
    await agent.discovery.update(
        engine=a.name,
        model=agent.config.model_name,
        contract=a.contract.fingerprint,
        accel=accel["kind"],
        accel_name=accel.get("name", ""),
    )


@router.post("/v1/config")
async def configure(body: ConfigBody, agent: Agent):
    """Check, and unless `dry_run` apply, an engine, model path, context length and staging budget.

    The model path is confined to this node's model roots and checked before anything loads;
    a switch waits for nothing: it is refused (409) while the node has work in flight."""
    model, context_length = await checked_model(body, agent)
    if body.dry_run:  # the contract the node would have, so a panel compares pairs before loading
        contract = await asyncio.to_thread(compute_contract, model, context_length, HashCache(hash_cache_path()))
        return {
            "ok": True,
            "changed": False,
            "model_path": str(model.path),
            "max_context": model.max_context,
            "contract": contract.to_dict(),
        }
    engine_changed = await agent.slot.replace(body.engine, model.path, context_length, agent.idle)
    if engine_changed:
        agent.config.model_name = model.path.name
        await announce(agent)
    changed = engine_changed
    if body.staging_bytes is not None and body.staging_bytes != agent.budget.capacity:
        agent.budget.resize(body.staging_bytes)
        changed = True
    changed = admit(agent, body, engine_changed) or changed
    changed = await keep_prefixes(agent, body, engine_changed) or changed
    return {"ok": True, "changed": changed, **agent.info()}


async def keep_prefixes(agent: AgentState, body: ConfigBody, engine_changed: bool) -> bool:
    """The prefix cache budget as the body sets it; a budget once set also holds for an engine
    loaded later (one never set follows the engine's default). True if it changed."""
    adapter, config = agent.slot.adapter, agent.config
    before = (adapter.prefix_cache_status() or {}).get("capacity")
    if body.prefix_cache_bytes is not None:
        config.prefix_cache_bytes = body.prefix_cache_bytes
    if config.prefix_cache_bytes is not None and (engine_changed or config.prefix_cache_bytes != before):
        # on the engine thread, which may be in a prefill chunk: the event loop does not wait for it
        await asyncio.to_thread(adapter.set_prefix_cache_bytes, config.prefix_cache_bytes)
    return (adapter.prefix_cache_status() or {}).get("capacity") != before


def admit(agent: AgentState, body: ConfigBody, engine_changed: bool) -> bool:
    """The decoder's KV budget and sequence cap as the body sets them; a budget never set follows
    the engine when another is loaded (its kv_budget_bytes). True if either changed."""
    config, admission = agent.config, agent.admission
    if body.decode_kv_bytes is not None:
        config.decode_kv_bytes = body.decode_kv_bytes
    if body.max_sequences is not None:
        config.max_sequences = body.max_sequences
    kv_bytes = config.decode_kv_bytes or (
        agent.slot.adapter.kv_budget_bytes() if engine_changed else admission.kv.capacity
    )
    if (kv_bytes, config.max_sequences) == (admission.kv.capacity, admission.sequences.capacity):
        return False
    admission.resize(kv_bytes, config.max_sequences)
    return True

"""What the UI asks an agent directly: its live status (or why there is none) and its checkpoints."""

from __future__ import annotations

import asyncio

from tandem_protocol.client import AgentClient, AgentHTTPError, TransportError
from tandem_protocol.pages import PROTOCOL_VERSION

from .. import pins
from ..services import PanelError, prove

STATUS_TIMEOUT = 3.0


async def probe(url: str, key: str | None) -> dict:
    """An agent's /v1/status, or why it failed: {"health": ok|timeout|key_rejected|protocol|unreachable|error}.
    With no key (a node not paired yet is sent none), only its liveness: "unpaired" when it is up."""
    # Liveness sends nothing secret, so it needs no pin (a node not paired yet has none).
    client = pins.agent_client(url, key, timeout=STATUS_TIMEOUT) if key else AgentClient(url, "", verify=False)
    try:
        if key is None:
            await asyncio.wait_for(client.healthz(), STATUS_TIMEOUT)
            return {"health": "unpaired", "detail": ""}
        status = await asyncio.wait_for(client.status(), STATUS_TIMEOUT)
    except TimeoutError as e:
        return {"health": "timeout", "detail": f"no answer within {STATUS_TIMEOUT:.0f} s" if not str(e) else str(e)}
    except AgentHTTPError as e:
        if e.status == 401:
            return {"health": "key_rejected", "detail": str(e)}
        if e.status == 400 and "protocol" in str(e):
            return {"health": "protocol", "detail": str(e)}
        return {"health": "error", "detail": str(e)}
    except TransportError as e:
        return {"health": "unreachable", "detail": f"{type(e).__name__}: {e}"}
    finally:
        await client.aclose()
    if status.get("protocol_version") != PROTOCOL_VERSION:
        return {
            "health": "protocol",
            "status": status,
            "detail": f"agent speaks protocol {status.get('protocol_version')}, panel speaks {PROTOCOL_VERSION}",
        }
    return {"health": "ok", "status": status, "detail": ""}


async def probe_proved(url: str, key: str) -> dict:
    """`probe`, but only once the agent at `url` has proved it holds `key` (`services.prove` sends
    no key): a typed or discovered URL may be an impostor, which must never be handed the key.
    A failed proof: {"health": "unproved", "detail": why}; one not up says so first (no key sent)."""
    if (alive := await probe(url, None))["health"] != "unpaired":
        return alive
    try:
        await prove(url, key)
    except PanelError as e:
        return {"health": "unproved", "detail": str(e)}
    return await probe(url, key)


async def node_models(url: str, key: str) -> list[dict]:
    """The checkpoints a node offers (for the pair form's model-path suggestions); [] if it does not answer."""
    client = pins.agent_client(url, key, timeout=STATUS_TIMEOUT)
    try:
        return (await asyncio.wait_for(client.local_models(), STATUS_TIMEOUT))["models"]
    except (TimeoutError, AgentHTTPError, *TransportError):
        return []
    finally:
        await client.aclose()

"""The agent API's declared dependencies: each route states what it needs through these aliases.
They are `async def`: FastAPI would run a plain `def` in a worker thread, on every request.

Every route but /healthz, /v1/identity and a handoff's page stream sits on a router with `KEYED`:
the cluster key as a bearer token, and, when a peer names its protocol version (X-Tandem-Protocol),
the same one as here. The page stream takes its handoff's read token instead (`SAME_PROTOCOL`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from tandem_protocol.auth import bearer_token, key_matches
from tandem_protocol.errors import RequestError
from tandem_protocol.pages import PROTOCOL_VERSION

from .engine_slot import EngineSlot
from .errors import Unauthorized
from .handoffs import HandoffManager
from .metrics import Metrics
from .state import AgentConfig, AgentState


async def agent_state(request: Request) -> AgentState:
    return request.app.state.agent


Agent = Annotated[AgentState, Depends(agent_state)]


async def agent_config(agent: Agent) -> AgentConfig:
    return agent.config


Config = Annotated[AgentConfig, Depends(agent_config)]


async def engine_slot(agent: Agent) -> EngineSlot:
    """The slot, not its engine: `slot.adapter` raises EngineLoading (503) while a switch is under
    way, so a route reads it in its body, after FastAPI has checked the request's body (a 400 first)."""
    return agent.slot


Slot = Annotated[EngineSlot, Depends(engine_slot)]


async def handoff_manager(agent: Agent) -> HandoffManager:
    return agent.handoffs


Handoffs = Annotated[HandoffManager, Depends(handoff_manager)]


async def agent_metrics(agent: Agent) -> Metrics:
    return agent.metrics


AgentMetrics = Annotated[Metrics, Depends(agent_metrics)]


async def same_protocol(x_tandem_protocol: int | None = Header(None)) -> None:
    if x_tandem_protocol is not None and x_tandem_protocol != PROTOCOL_VERSION:
        raise RequestError(
            f"peer speaks Tandem protocol {x_tandem_protocol}, this agent speaks "
            f"{PROTOCOL_VERSION}: run the same Tandem version on both machines"
        )


async def cluster_key(config: Config, authorization: str | None = Header(None)) -> None:
    if not key_matches(bearer_token(authorization), config.cluster_key):
        raise Unauthorized()


SAME_PROTOCOL = [Depends(same_protocol)]  # a router whose routes check a credential of their own
KEYED = [Depends(cluster_key), *SAME_PROTOCOL]  # a router's `dependencies`: the cluster key needed

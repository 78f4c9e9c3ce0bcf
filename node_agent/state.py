"""What one agent process holds while it runs: its configuration, its engine slot, the staging
budget, the decoder's admission, the open handoffs and the metrics, built once by `create_app` and kept on
`app.state.agent`; routes reach it through the dependencies in `deps.py`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine_adapters.base import EngineAdapter
from tandem_protocol.client import AgentClient
from tandem_protocol.pages import ENCODINGS, PROTOCOL_VERSION

from .admission import MAX_SEQUENCES, WAIT_SECONDS, Admission
from .budget import StagingBudget
from .engine_slot import EngineSlot, Loader
from .handoffs import HandoffManager
from .metrics import Metrics


@dataclass
class AgentConfig:
    node_id: str
    name: str
    cluster_key: str
    staging_bytes: int = 512 << 20
    decode_kv_bytes: int | None = None  # the decoder's KV budget (None: the engine's kv_budget_bytes)
    max_sequences: int = MAX_SEQUENCES  # requests the engine decodes at once
    admission_wait: float = WAIT_SECONDS  # how long a request may wait for them before its 429
    prefix_cache_bytes: int | None = None  # the engine's prefix cache budget (None: the engine's default)
    handoff_ttl: float = 60.0
    model_name: str = ""
    url: str = ""  # where this agent listens (for logs)
    model_roots: list = field(default_factory=list)  # directories POST /v1/config may load models from
    # A page stream that moves no byte for this long is broken (a cable pulled, a peer frozen):
    # the decoder gives up reading it and the prefiller gives up writing it, and both let go of
    # what they hold. It must exceed the longest gap between two pages (one prefill chunk).
    stall_timeout: float = 60.0
    # host:port addresses (canonical) this agent is also reached at — a port forward or a proxy in
    # front of it — which it signs in an identity proof when a caller names one of them
    advertised: frozenset[str] = frozenset()
    tls_fingerprint: str = ""  # SHA-256 of the certificate this agent serves ("" over plain HTTP)


class AgentState:
    def __init__(
        self, adapter: EngineAdapter, config: AgentConfig, discovery: Any = None, loader: Loader | None = None
    ):
        self.config, self.discovery, self.loader = config, discovery, loader
        self.metrics = Metrics()
        self.budget = StagingBudget(config.staging_bytes)
        self.slot = EngineSlot(adapter, loader)
        if config.prefix_cache_bytes is not None:
            adapter.set_prefix_cache_bytes(config.prefix_cache_bytes)
        self.admission = Admission(
            config.decode_kv_bytes or adapter.kv_budget_bytes(), config.max_sequences, config.admission_wait
        )
        self.handoffs = HandoffManager(self.slot, self.budget, self.metrics, ttl=config.handoff_ttl)
        self.metrics.bind(
            capacity=lambda: self.budget.capacity,
            reserved=lambda: self.budget.reserved,
            waiting=lambda: self.budget.waiting,
            open_handoffs=lambda: len(self.handoffs.handoffs),
            active=lambda: self.slot.adapter.active_requests if self.slot.ready else 0,
            admission=self.admission,
            prefix_cache=lambda: (self.slot.adapter.prefix_cache_status() if self.slot.ready else None) or {},
        )
        # one pooled HTTP client per prefiller (and the certificate pinned for it): connections are reused
        self.peers: dict[tuple[str, str | None], AgentClient] = {}
        self.started = time.time()

    def peer(self, url: str, tls_fingerprint: str | None = None) -> AgentClient:
        """The client for the prefiller at `url`; over HTTPS it must present the certificate
        `tls_fingerprint` (what the panel pinned at pairing and sends with each request)."""
        key = (url.rstrip("/"), tls_fingerprint)
        if key not in self.peers:
            config = self.config
            self.peers[key] = AgentClient(key[0], config.cluster_key, stall_timeout=config.stall_timeout, pin=key[1])
        return self.peers[key]

    def idle(self) -> bool:
        return (
            not self.handoffs.handoffs
            and not self.handoffs.waiting
            and self.budget.reserved == 0
            and self.budget.waiting == 0
            and self.admission.kv.reserved == 0
            and self.admission.sequences.reserved == 0
            and self.slot.adapter.active_requests == 0
        )

    def info(self) -> dict:
        config, slot = self.config, self.slot
        base = {
            "node_id": config.node_id,
            "name": config.name,
            "protocol_version": PROTOCOL_VERSION,
            "state": "ready" if slot.ready else "loading",
            "model_roots": [str(r) for r in config.model_roots],
            "switchable": self.loader is not None,
            "tls_fingerprint": config.tls_fingerprint,
        }
        if not slot.ready:
            return {
                **base,
                "engine": None,
                "model": slot.loading,
                "contract": None,
                "decoder_modes": [],
                "accelerator": {},
                "page_bytes": 0,
                "context_length": 0,
                "last_error": slot.last_error,
            }
        a = slot.adapter
        return {
            **base,
            "engine": a.name,
            "model": config.model_name or a.model_dir.name,
            "model_path": str(a.model_dir),
            "contract": a.contract.to_dict(),
            "decoder_modes": [m.value for m in a.decoder_modes],
            "first_token_sampling": sorted(a.first_token_sampling),
            "sampling": sorted(a.sampling),
            "accelerator": a.accelerator(),
            "page_bytes": a.geometry.page_bytes,
            "context_length": a.context_length,
            "vocab_size": a.info.vocab_size,
            "page_encodings": sorted(ENCODINGS),
        }

    async def start(self) -> None:
        if self.discovery is not None:
            await self.discovery.start()

    async def aclose(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.handoffs.close()
        for client in self.peers.values():
            await client.aclose()

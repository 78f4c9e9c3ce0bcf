"""Prometheus metrics of one agent (prometheus-client, in a registry of the agent's own)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds
        self.pages_sent = Counter("tandem_pages_sent", "KV pages sent to decoders", registry=r)
        self.bytes_sent = Counter("tandem_page_bytes_sent", "Framed page bytes sent to decoders", registry=r)
        self.pages_received = Counter("tandem_pages_received", "KV pages received from prefillers", registry=r)
        self.bytes_received = Counter("tandem_page_bytes_received", "Page stream bytes received", registry=r)
        self.imported_tokens = Counter("tandem_imported_tokens", "Prompt tokens of KV imported", registry=r)
        self.generated_tokens = Counter("tandem_generated_tokens", "Tokens generated", registry=r)
        self.handoffs_created = Counter("tandem_handoffs_created", "Handoffs created", registry=r)
        self.handoffs_finished = Counter(
            "tandem_handoffs_finished", "Handoffs ended, by outcome", ["outcome"], registry=r
        )
        self.requests = Counter(
            "tandem_requests", "Decode and generate requests, by outcome", ["kind", "outcome"], registry=r
        )
        self.prefill_seconds = Histogram(
            "tandem_handoff_prefill_seconds",
            "Prefill time of handoffs on this engine (its own clock)",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.budget_capacity = Gauge("tandem_budget_capacity_bytes", "Staging budget capacity", registry=r)
        self.budget_reserved = Gauge("tandem_budget_reserved_bytes", "Staging bytes reserved", registry=r)
        self.budget_waiting = Gauge("tandem_budget_waiting_requests", "Requests waiting for budget", registry=r)
        self.open_handoffs = Gauge("tandem_open_handoffs", "Handoffs holding pages", registry=r)
        self.active_requests = Gauge("tandem_engine_active_requests", "Requests holding engine memory", registry=r)
        self.decode_kv_capacity = Gauge("tandem_decode_kv_capacity_bytes", "Decode KV budget", registry=r)
        self.decode_kv_reserved = Gauge("tandem_decode_kv_reserved_bytes", "Decode KV held by requests", registry=r)
        self.decode_running = Gauge("tandem_decode_running_requests", "Requests admitted to decode", registry=r)
        self.decode_waiting = Gauge("tandem_decode_waiting_requests", "Requests waiting for admission", registry=r)
        self.prefix_cache = {
            key: Gauge(f"tandem_prefix_cache_{key}", doc, registry=r)
            for key, doc in (
                ("capacity", "Prefix cache budget, bytes"),
                ("bytes", "Prefix cache pages held, bytes"),
                ("pages", "Prefix cache pages held"),
                ("lookup_tokens", "Prompt tokens looked up in the prefix cache since the engine loaded"),
                ("hit_tokens", "Prompt tokens served from the prefix cache since the engine loaded"),
            )
        }

    def bind(
        self,
        *,
        capacity: Callable[[], float],
        reserved: Callable[[], float],
        waiting: Callable[[], float],
        open_handoffs: Callable[[], float],
        active: Callable[[], float],
        admission,
        prefix_cache: Callable[[], dict],
    ) -> None:
        """Gauges read live values when scraped."""
        self.budget_capacity.set_function(capacity)
        self.budget_reserved.set_function(reserved)
        self.budget_waiting.set_function(waiting)
        self.open_handoffs.set_function(open_handoffs)
        self.active_requests.set_function(active)
        self.decode_kv_capacity.set_function(lambda: admission.kv.capacity)
        self.decode_kv_reserved.set_function(lambda: admission.kv.reserved)
        self.decode_running.set_function(lambda: admission.running)
        self.decode_waiting.set_function(lambda: admission.status()["waiting"])
        for key, gauge in self.prefix_cache.items():
            gauge.set_function(lambda key=key: prefix_cache().get(key, 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    @staticmethod
    def value(counter) -> float:
        return counter._value.get()

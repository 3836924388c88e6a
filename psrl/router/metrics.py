"""Prometheus metrics: request counters and latency histograms updated per request, and instance gauges read
from the registry only when /metrics is scraped (no per-request cost)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from psrl.router.registry import WorkerRegistry

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _InstanceCollector(Collector):
    def __init__(self, workers: WorkerRegistry) -> None:
        self._workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["worker_id", "dp_rank"]
        families: dict[str, tuple[GaugeMetricFamily, Callable]] = {
            "load": (
                GaugeMetricFamily(
                    "psrl_router_instance_load",
                    "queued requests (max of router in-flight and the engine's running+waiting)",
                    labels=labels,
                ),
                lambda i: i.load,
            ),
            "inflight": (
                GaugeMetricFamily("psrl_router_instance_inflight", "requests the router has in flight", labels=labels),
                lambda i: i.inflight,
            ),
            "version": (
                GaugeMetricFamily("psrl_router_instance_weight_version", "synced weight version", labels=labels),
                lambda i: i.weight_version,
            ),
            "kv": (
                GaugeMetricFamily(
                    "psrl_router_instance_kv_cache_usage", "last reported KV usage (0..1)", labels=labels
                ),
                lambda i: i.stats.kv_cache_usage,
            ),
            "healthy": (
                GaugeMetricFamily("psrl_router_instance_healthy", "1 when healthy", labels=labels),
                lambda i: int(i.healthy),
            ),
            "paused": (
                GaugeMetricFamily("psrl_router_instance_paused", "1 when paused", labels=labels),
                lambda i: int(i.paused),
            ),
        }
        for inst in self._workers.instances():
            values = [inst.id.base_worker_id, str(inst.id.dp_rank)]
            for family, read in families.values():
                family.add_metric(values, read(inst))
        for family, _ in families.values():
            yield family


class FunctionCounter(Collector):
    """A counter that another object keeps (a plain int it increments), read when /metrics is scraped."""

    def __init__(self, name: str, documentation: str) -> None:
        self._name = name
        self._documentation = documentation
        self._read: Callable[[], float] = lambda: 0

    def set_function(self, read: Callable[[], float]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self._name, self._documentation, value=self._read())


class LabeledFunctionCounter(Collector):
    """Counters by one label that another object keeps (a dict of plain ints), read when /metrics is scraped."""

    def __init__(self, name: str, documentation: str, label: str) -> None:
        self._name = name
        self._documentation = documentation
        self._label = label
        self._read: Callable[[], Mapping[str, float]] = dict

    def set_function(self, read: Callable[[], Mapping[str, float]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._documentation, labels=[self._label])
        for value, count in sorted(self._read().items()):
            family.add_metric([value], count)
        yield family


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "psrl_router_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "psrl_router_request_duration_seconds",
            "time to the last byte",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "psrl_router_time_to_first_token_seconds",
            "time to the first generated token",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.selections = Counter(
            "psrl_router_selections",
            "selection outcomes by the selection step that decided (label `stage`)",
            ["stage", "outcome"],
            registry=self.registry,
        )
        self.kv_transfers = Counter(
            "psrl_router_kv_transfers",
            "loop-backs sent with kv_transfer_params, by outcome (moved: the replica pulled the KV; recomputed: "
            "it prefilled instead)",
            ["outcome"],
            registry=self.registry,
        )
        self.kv_transfer_tokens = Counter(
            "psrl_router_kv_transfer_tokens",
            "prompt tokens whose KV moved to a loop-back's new instance",
            registry=self.registry,
        )
        self.tito_sessions = Gauge("psrl_router_tito_sessions", "TITO sessions held", registry=self.registry)
        self.tito_sessions_expired = FunctionCounter(
            "psrl_router_tito_sessions_expired", "TITO sessions dropped after --tito-session-ttl-s idle"
        )
        self.registry.register(self.tito_sessions_expired)
        self.tito_turns_not_exported = LabeledFunctionCounter(
            "psrl_router_tito_turns_not_exported",
            "sampled TITO turns in no exported trajectory, by reason (dropped_branch: --tito-drop-dead-leaves; "
            "session_expired: the session expired before a snapshot included them)",
            "reason",
        )
        self.registry.register(self.tito_turns_not_exported)
        self.queue_length = Gauge("psrl_router_queue_length", "requests waiting to be routed", registry=self.registry)
        self.registry.register(_InstanceCollector(workers))

        self._children: dict[tuple, Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        """labels() takes a lock and builds a key each call: cache the children on the hot path."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request_done(self, route: str, status: int, seconds: float | None) -> None:
        self._child(self.requests, route, str(status)).inc()
        if seconds is not None:
            self._child(self.latency, route).observe(seconds)

    def stream_done(self, route: str, seconds: float) -> None:
        self._child(self.latency, route).observe(seconds)

    def first_token(self, route: str, seconds: float) -> None:
        self._child(self.ttft, route).observe(seconds)

    def selected(self, step: str, chosen: bool) -> None:
        """One selection, by the step that decided it (the metric's `stage` label, kept for dashboards)."""
        self._child(self.selections, step, "chosen" if chosen else "none").inc()

    def kv_transfer(self, moved_tokens: int) -> None:
        """One loop-back dispatched with KV transfer params; the replica reported `moved_tokens` moved in."""
        self._child(self.kv_transfers, "moved" if moved_tokens > 0 else "recomputed").inc()
        self.kv_transfer_tokens.inc(moved_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

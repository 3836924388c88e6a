"""Prometheus metrics: request counters and latency histograms updated per request, and instance gauges read
from the registry only when /metrics is scraped (no per-request cost).

What is updated per request is kept in plain dicts of numbers (`LoopCounter`, `LoopHistogram`), which only the
event loop's thread writes, and prometheus_client renders them when /metrics is scraped. Its own Counter and
Histogram take a lock for every increment (a histogram's observe: two, after a Python loop over its buckets),
and with the label lookups that cost the router some 10 Python calls a request."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

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


class _LoopMetric(Collector):
    """A metric updated per request, written by one thread (the event loop) with no lock. Its series are keyed by
    their label values, a tuple in the order of `labels`; each records when it began (prometheus_client's
    `_created`)."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = list(labels)
        self._created: dict[tuple[str, ...], float] = {}

    def _begin(self, values: tuple[str, ...]) -> None:
        self._created[values] = time.time()


class LoopCounter(_LoopMetric):
    def __init__(self, name: str, documentation: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labels)
        self._counts: dict[tuple[str, ...], float] = {}
        if not self._labels:
            self.inc(amount=0.0)  # an unlabelled counter is there from the start, at 0, as prometheus_client's is

    def inc(self, values: tuple[str, ...] = (), amount: float = 1.0) -> None:
        counts = self._counts
        if values in counts:
            counts[values] += amount
        else:
            counts[values] = amount
            self._begin(values)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labels)
        for values, count in list(self._counts.items()):
            family.add_metric(values, count, created=self._created[values])
        yield family


class LoopHistogram(_LoopMetric):
    """Per series, a count per bucket (not cumulative: the one the value falls in) and the sum, made cumulative
    when scraped."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str], buckets: Sequence[float]) -> None:
        super().__init__(name, documentation, labels)
        self._bounds = (*(float(b) for b in buckets), float("inf"))
        self._les = [floatToGoString(b) for b in self._bounds]
        self._series: dict[tuple[str, ...], list[float]] = {}  # bucket counts, then the sum

    def observe(self, values: tuple[str, ...], value: float) -> None:
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = [0.0] * (len(self._bounds) + 1)
            self._begin(values)
        series[bisect_left(self._bounds, value)] += 1  # the first bucket whose bound is >= value
        series[-1] += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labels)
        for values, series in list(self._series.items()):
            total, buckets = 0.0, []
            for le, count in zip(self._les, series[:-1], strict=True):
                total += count
                buckets.append((le, total))
            family.add_metric(values, buckets, sum_value=series[-1])
            labels = dict(zip(self._labels, values, strict=True))
            family.samples.append(Sample(f"{self._name}_created", labels, self._created[values]))
        yield family


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry) -> None:
        self.registry = CollectorRegistry()
        self.requests = LoopCounter("psrl_router_requests", "HTTP requests by route and status", ["route", "status"])
        self.latency = LoopHistogram(
            "psrl_router_request_duration_seconds", "time to the last byte", ["route"], _LATENCY_BUCKETS
        )
        self.ttft = LoopHistogram(
            "psrl_router_time_to_first_token_seconds", "time to the first generated token", ["route"], _LATENCY_BUCKETS
        )
        self.selections = LoopCounter(
            "psrl_router_selections",
            "selection outcomes by the selection step that decided (label `stage`)",
            ["stage", "outcome"],
        )
        self.kv_transfers = LoopCounter(
            "psrl_router_kv_transfers",
            "loop-backs sent with kv_transfer_params, by outcome (moved: the replica pulled the KV; recomputed: "
            "it prefilled instead)",
            ["outcome"],
        )
        self.kv_transfer_tokens = LoopCounter(
            "psrl_router_kv_transfer_tokens", "prompt tokens whose KV moved to a loop-back's new instance"
        )
        for metric in (
            self.requests,
            self.latency,
            self.ttft,
            self.selections,
            self.kv_transfers,
            self.kv_transfer_tokens,
        ):
            self.registry.register(metric)
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

    def request_done(self, route: str, status: int, seconds: float | None) -> None:
        self.requests.inc((route, str(status)))
        if seconds is not None:
            self.latency.observe((route,), seconds)

    def stream_done(self, route: str, seconds: float) -> None:
        self.latency.observe((route,), seconds)

    def first_token(self, route: str, seconds: float) -> None:
        self.ttft.observe((route,), seconds)

    def selected(self, step: str, chosen: bool) -> None:
        """One selection, by the step that decided it (the metric's `stage` label, kept for dashboards)."""
        self.selections.inc((step, "chosen" if chosen else "none"))

    def kv_transfer(self, moved_tokens: int) -> None:
        """One loop-back dispatched with KV transfer params; the replica reported `moved_tokens` moved in."""
        self.kv_transfers.inc(("moved" if moved_tokens > 0 else "recomputed",))
        self.kv_transfer_tokens.inc(amount=moved_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

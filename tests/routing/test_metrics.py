"""The router's per-request metrics (plain counters read when /metrics is scraped) render as prometheus_client's
own Counter and Histogram would for the same updates."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from psrl.router.metrics import LoopCounter, LoopHistogram

BUCKETS = (0.005, 0.01, 0.5, 1, 300)
# On a bound, next to one, between, past the last bound, zero and negative: each bucket edge is `le`.
VALUES = (0.005, 0.00500001, 0.0049, 0.01, 0.2, 1, 1.0000001, 300, 301, 1e9, 0.0, -3.5)


def _rendered(registry: CollectorRegistry) -> list[str]:
    """The exposition lines, with the `_created` timestamps (times of the first update) masked."""
    text = generate_latest(registry).decode()
    return [re.sub(r"^(\S+_created(\{[^}]*\})?) \S+$", r"\1 T", line) for line in text.splitlines()]


def test_a_histogram_renders_as_prometheus_clients_own() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("h_seconds", "doc", ["route", "kind"], BUCKETS)
    ours.register(loop)
    reference = Histogram("h_seconds", "doc", ["route", "kind"], buckets=BUCKETS, registry=theirs)
    assert _rendered(ours) == _rendered(theirs)  # no series yet: the help and type lines alone
    for i, value in enumerate(VALUES):
        labels = ("/a", "x") if i % 3 else ("/b", "y")
        loop.observe(labels, value)
        reference.labels(*labels).observe(value)
    assert _rendered(ours) == _rendered(theirs)
    assert 'h_seconds_bucket{kind="x",le="0.005",route="/a"}' in generate_latest(ours).decode()


def test_a_counter_renders_as_prometheus_clients_own() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop, bare = LoopCounter("c", "doc", ["route", "status"]), LoopCounter("tokens", "doc")
    ours.register(loop)
    ours.register(bare)
    reference = Counter("c", "doc", ["route", "status"], registry=theirs)
    reference_bare = Counter("tokens", "doc", registry=theirs)
    assert _rendered(ours) == _rendered(theirs)  # before any update: no labelled series, the bare one at 0
    for labels, amount in [(("/a", "200"), 1), (("/a", "500"), 1), (("/a", "200"), 2.5), (("/b", "200"), 1)]:
        loop.inc(labels, amount)
        reference.labels(*labels).inc(amount)
    bare.inc(amount=7)
    reference_bare.inc(7)
    assert _rendered(ours) == _rendered(theirs)
    assert 'c_total{route="/a",status="200"} 3.5' in generate_latest(ours).decode()


def test_a_series_is_created_once_and_reports_when() -> None:
    registry = CollectorRegistry()
    counter = LoopCounter("c", "doc", ["route"])
    registry.register(counter)
    counter.inc(("/a",))
    first = generate_latest(registry).decode()
    counter.inc(("/a",))
    again = generate_latest(registry).decode()
    created = [line for line in first.splitlines() if line.startswith("c_created")]
    assert len(created) == 1
    assert created[0] in again  # the series' creation time does not move
    assert 'c_total{route="/a"} 2.0' in again

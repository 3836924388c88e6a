"""Health thresholds and the circuit breaker, driven by hand."""

from __future__ import annotations

from psrl.router.config import BreakerConfig, HealthConfig
from psrl.router.health import BreakerState, CircuitBreaker, HealthTracker
from psrl.router.registry import SchedulerStats, WorkerRegistry


def test_health_thresholds() -> None:
    h = HealthTracker(HealthConfig(failure_threshold=2, success_threshold=2))
    assert not h.record(False) and h.healthy
    assert h.record(False) and not h.healthy
    assert not h.record(True) and not h.healthy
    assert h.record(True) and h.healthy
    h.mark_down()
    assert not h.healthy
    h.record(True)
    assert h.record(True) and h.healthy


def test_breaker_opens_half_opens_and_closes() -> None:
    b = CircuitBreaker(BreakerConfig(failure_threshold=2, success_threshold=1, open_duration_s=10))
    b.record(False, 0)
    assert b.state is BreakerState.CLOSED and b.allows(0)
    b.record(True, 0)  # a success resets the count
    b.record(False, 0)
    assert b.allows(0)
    b.record(False, 1)
    assert b.state is BreakerState.OPEN and not b.allows(5)
    assert b.allows(11) and b.state is BreakerState.HALF_OPEN
    b.on_dispatch()
    assert not b.allows(11)  # one trial at a time
    b.record(False, 12)
    assert b.state is BreakerState.OPEN and not b.allows(13)
    assert b.allows(22)
    b.on_dispatch()
    b.record(True, 22)
    assert b.state is BreakerState.CLOSED and b.allows(22)


def test_a_worker_that_is_down_reports_no_running_requests() -> None:
    reg = WorkerRegistry()
    worker = reg.create_worker("w", "grpc://h:1", models=["m"], labels={}, dp_size=1)
    [inst] = worker.instances
    inst.stats = SchedulerStats(num_running_reqs=7, num_waiting_reqs=2, kv_cache_usage=0.5)
    inst.inflight = 1
    assert inst.to_json()["running_requests"] == 7 and inst.load == 9
    worker.health.mark_down()  # its last report is stale now: a dead engine runs nothing
    described = inst.to_json()
    assert (described["running_requests"], described["waiting_requests"], described["kv_cache_usage"]) == (0, 0, 0)
    assert inst.load == 1 and worker.to_json()["load"] == 1  # what the router itself still has in flight

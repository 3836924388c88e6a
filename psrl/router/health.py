"""Health bookkeeping, pure: worker health with failure/success thresholds, and a per-instance circuit breaker."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from psrl.router.config import BreakerConfig, HealthConfig


@dataclass
class HealthTracker:
    config: HealthConfig
    healthy: bool = True
    _failures: int = 0
    _successes: int = 0

    def record(self, passed: bool) -> bool:
        """Count one check; returns True when the healthy flag changed."""
        if passed:
            self._failures = 0
            self._successes += 1
            if not self.healthy and self._successes >= self.config.success_threshold:
                self.healthy = True
                return True
        else:
            self._successes = 0
            self._failures += 1
            if self.healthy and self._failures >= self.config.failure_threshold:
                self.healthy = False
                return True
        return False

    def mark_down(self) -> None:
        """A connection failure seen on the data path: out of rotation now, back after success_threshold checks."""
        self.healthy = False
        self._successes = 0
        self._failures = self.config.failure_threshold


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    config: BreakerConfig
    state: BreakerState = BreakerState.CLOSED
    _failures: int = 0
    _successes: int = 0
    _opened_at: float = 0.0
    _trial_in_flight: bool = False

    def allows(self, now: float) -> bool:
        """May a request be sent now? An open breaker turns half-open after its open duration."""
        if self.state is BreakerState.CLOSED:  # the common case, asked per instance per selection
            return True
        if self.state is BreakerState.OPEN and now - self._opened_at >= self.config.open_duration_s:
            self.state = BreakerState.HALF_OPEN
            self._successes = 0
            self._trial_in_flight = False
        return self.state is BreakerState.HALF_OPEN and not self._trial_in_flight

    def on_dispatch(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def record(self, success: bool, now: float) -> None:
        if success:
            self._failures = 0
            if self.state is BreakerState.HALF_OPEN:
                self._trial_in_flight = False
                self._successes += 1
                if self._successes >= self.config.success_threshold:
                    self.state = BreakerState.CLOSED
            return
        self._failures += 1
        if self.state is BreakerState.HALF_OPEN or self._failures >= self.config.failure_threshold:
            self.state = BreakerState.OPEN
            self._opened_at = now
            self._trial_in_flight = False

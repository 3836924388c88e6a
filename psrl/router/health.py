"""Health bookkeeping, pure: worker health with failure/success thresholds, a per-instance circuit breaker, and
the count of changes to what makes an instance available."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from psrl.router.config import BreakerConfig, HealthConfig

_availability_changes = 0


def availability_changed() -> None:
    """Something that decides whether an instance is available changed: a worker's health, an instance's pause or
    synced version, a circuit breaker's state. Selection keeps the list of available instances until the count
    moves (`Selector.available`), so each write of one of these must count."""
    global _availability_changes
    _availability_changes += 1


def availability_changes() -> int:
    """How many such changes this process has seen."""
    return _availability_changes


@dataclass
class HealthTracker:
    config: HealthConfig
    _healthy: bool = True
    _failures: int = 0
    _successes: int = 0

    @property
    def healthy(self) -> bool:
        return self._healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        if value != self._healthy:
            self._healthy = value
            availability_changed()

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
    _state: BreakerState = BreakerState.CLOSED
    _failures: int = 0
    _successes: int = 0
    _opened_at: float = 0.0
    _trial_in_flight: bool = False

    @property
    def state(self) -> BreakerState:
        return self._state

    @state.setter
    def state(self, value: BreakerState) -> None:
        if value is not self._state:
            self._state = value
            availability_changed()

    def allows(self, now: float) -> bool:
        """May a request be sent now? An open breaker turns half-open after its open duration. (Only a breaker
        that is not closed changes its answer without a write: selection does not keep an answer that had one.)"""
        if self._state is BreakerState.CLOSED:  # the common case
            return True
        if self._state is BreakerState.OPEN and now - self._opened_at >= self.config.open_duration_s:
            self.state = BreakerState.HALF_OPEN
            self._successes = 0
            self._trial_in_flight = False
        return self._state is BreakerState.HALF_OPEN and not self._trial_in_flight

    def on_dispatch(self) -> None:
        if self._state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def record(self, success: bool, now: float) -> None:
        if success:
            self._failures = 0
            if self._state is BreakerState.HALF_OPEN:
                self._trial_in_flight = False
                self._successes += 1
                if self._successes >= self.config.success_threshold:
                    self.state = BreakerState.CLOSED
            return
        self._failures += 1
        if self._state is BreakerState.HALF_OPEN or self._failures >= self.config.failure_threshold:
            self.state = BreakerState.OPEN
            self._opened_at = now
            self._trial_in_flight = False

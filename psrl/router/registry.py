"""The worker registry: registered workers, each carrying dp_size selectable instances (base id, rank).

Pure bookkeeping, no sockets: the HTTP handlers, the health loop and the stats/version pushes call into it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from psrl.router.config import BreakerConfig, ConnectionMode, HealthConfig
from psrl.router.health import CircuitBreaker, HealthTracker, availability_changed


class InstanceId(NamedTuple):
    """A tuple so that hashing and comparing it (every dict lookup on the hot path) runs in C."""

    base_worker_id: str
    dp_rank: int

    def __str__(self) -> str:
        return f"{self.base_worker_id}@{self.dp_rank}"


@dataclass
class SchedulerStats:
    """What the coordinator pushes with /workers/update_stats (or GetLoads polling fills in)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    req_id_to_prompt_token_num: dict[str, int] = field(default_factory=dict)
    req_id_to_response_token_num: dict[str, int] = field(default_factory=dict)
    timestamp: float = 0.0  # seconds since the epoch of the report; older reports are stale


@dataclass(eq=False)
class InstanceState:
    """One data-parallel rank of a worker: what selection looks at and what dispatch updates."""

    id: InstanceId
    worker: Worker
    breaker: CircuitBreaker
    inflight: int = 0  # requests the router has dispatched here and not yet seen end
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    _paused: bool = False
    _synced_version: int | None = None  # from /workers/update_weight_version

    # Both decide whether the instance is available, so each change counts (`availability_changed`).
    @property
    def paused(self) -> bool:
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        if value != self._paused:
            self._paused = value
            availability_changed()

    @property
    def synced_version(self) -> int | None:
        return self._synced_version

    @synced_version.setter
    def synced_version(self, value: int | None) -> None:
        if value != self._synced_version:
            self._synced_version = value
            availability_changed()

    @property
    def weight_version(self) -> int:
        """The synced version, else the worker's label fallback (unknown -> 0), as SMG does."""
        synced = self._synced_version
        return synced if synced is not None else self.worker.label_weight_version

    @property
    def reported(self) -> SchedulerStats:
        """What the engine last reported; nothing while the worker is down (a dead engine runs nothing, and a
        stale count would hold up whoever waits for requests to drain)."""
        return self.stats if self.healthy else SchedulerStats()

    @property
    def load(self) -> int:
        """Queue depth: the larger of what we dispatched and what the engine last reported (nothing while down,
        as `reported`). Load-aware policies read it for every candidate of every request, so it reads the fields
        itself rather than through `reported` and `healthy`."""
        if not self.worker.health.healthy:
            return self.inflight
        stats = self.stats
        return max(self.inflight, stats.num_running_reqs + stats.num_waiting_reqs)

    @property
    def healthy(self) -> bool:
        return self.worker.health.healthy

    def available(self, now: float | None = None) -> bool:
        """Selectable: healthy, not paused, and its circuit breaker lets a request through."""
        return self.healthy and not self.paused and self.breaker.allows(time.monotonic() if now is None else now)

    def to_json(self) -> dict[str, Any]:
        return {
            "worker_id": self.id.base_worker_id,
            "base_worker_id": self.id.base_worker_id,
            "dp_rank": self.id.dp_rank,
            "url": self.worker.url,
            "healthy": self.healthy,
            "paused": self.paused,
            "circuit_breaker": self.breaker.state.value,
            "weight_version": self.weight_version,
            "running_requests": self.reported.num_running_reqs,
            "waiting_requests": self.reported.num_waiting_reqs,
            "kv_cache_usage": self.reported.kv_cache_usage,
            "inflight_requests": self.inflight,
            "load": self.load,
        }


@dataclass(eq=False)
class Worker:
    worker_id: str
    url: str
    models: list[str]
    labels: dict[str, str]
    health: HealthTracker
    dp_size: int = 1
    connection_mode: ConnectionMode = ConnectionMode.GRPC
    max_context_length: int = 0
    kv_block_size: int = 0
    label_weight_version: int = 0
    instances: list[InstanceState] = field(default_factory=list)

    # A worker's url never changes: these are read per request, so they are worked out once.
    @cached_property
    def target(self) -> str:
        """host:port (the gRPC target, or the HTTP authority)."""
        return urlsplit(self.url).netloc

    @cached_property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    def serves(self, model: str | None) -> bool:
        return model is None or model in self.models

    def instance(self, dp_rank: int) -> InstanceState | None:
        return self.instances[dp_rank] if 0 <= dp_rank < len(self.instances) else None

    def to_json(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "id": self.worker_id,
            "url": self.url,
            "models": [{"id": m} for m in self.models],
            "labels": dict(self.labels),
            "dp_size": self.dp_size,
            "connection_mode": self.connection_mode,
            "max_context_length": self.max_context_length,
            "kv_block_size": self.kv_block_size,
            "healthy": self.healthy,
            "load": sum(i.load for i in self.instances),
            "instances": [i.to_json() for i in self.instances],
        }


class ModelView(NamedTuple):
    """The workers serving a model and their instances, in registration order, available or not."""

    workers: tuple[Worker, ...]
    instances: tuple[InstanceState, ...]
    grpc_instances: tuple[InstanceState, ...]  # those of gRPC workers: the ones that take token ids


@dataclass
class WorkerRegistry:
    health_config: HealthConfig = field(default_factory=HealthConfig)
    breaker_config: BreakerConfig = field(default_factory=BreakerConfig)
    _workers: dict[str, Worker] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(0))
    # Read per request and changed only when a worker is added or removed: worked out once per change, so a
    # request costs no scan of the fleet. Only served models (and None: any) are kept, so the map stays small.
    _views: dict[str | None, ModelView] = field(default_factory=dict)
    _models: tuple[str, ...] | None = None

    def new_id(self) -> str:
        while True:
            candidate = str(next(self._ids))
            if candidate not in self._workers:
                return candidate

    def create_worker(
        self,
        worker_id: str,
        url: str,
        *,
        models: list[str],
        labels: dict[str, str],
        dp_size: int = 1,
        connection_mode: str = ConnectionMode.GRPC,
        max_context_length: int = 0,
        kv_block_size: int = 0,
        label_weight_version: int = 0,
    ) -> Worker:
        """Build a worker with its instances and add it (replacing one with the same id)."""
        worker = Worker(
            worker_id=worker_id,
            url=url,
            models=list(models),  # its own list: the views above assume it never changes
            labels=labels,
            health=HealthTracker(self.health_config),
            dp_size=dp_size,
            connection_mode=ConnectionMode(connection_mode),
            max_context_length=max_context_length,
            kv_block_size=kv_block_size,
            label_weight_version=label_weight_version,
        )
        worker.instances = [
            InstanceState(InstanceId(worker_id, rank), worker, CircuitBreaker(self.breaker_config))
            for rank in range(dp_size)
        ]
        self._workers[worker_id] = worker
        self._changed()
        return worker

    def _changed(self) -> None:
        self._views.clear()
        self._models = None

    def by_url(self, url: str) -> Worker | None:
        return next((w for w in self._workers.values() if w.url == url), None)

    def remove(self, worker_id: str) -> Worker | None:
        worker = self._workers.pop(worker_id, None)
        self._changed()
        return worker

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def instance(self, iid: InstanceId) -> InstanceState | None:
        worker = self._workers.get(iid.base_worker_id)
        return None if worker is None else worker.instance(iid.dp_rank)

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def instances(self) -> list[InstanceState]:
        return [i for w in self._workers.values() for i in w.instances]

    def models(self) -> tuple[str, ...]:
        """The served models, in the order their first worker registered."""
        if self._models is None:
            self._models = tuple(dict.fromkeys(m for w in self._workers.values() for m in w.models))
        return self._models

    def view(self, model: str | None) -> ModelView:
        """The workers serving `model` (None: any) and their instances."""
        view = self._views.get(model)
        if view is None:
            workers = tuple(w for w in self._workers.values() if w.serves(model))
            instances = tuple(i for w in workers for i in w.instances)
            grpc = tuple(i for i in instances if i.worker.connection_mode is ConnectionMode.GRPC)
            view = ModelView(workers, instances, grpc)
            if workers:
                self._views[model] = view
        return view

    def serving(self, model: str | None) -> tuple[Worker, ...]:
        return self.view(model).workers

    def instances_of(self, model: str | None) -> tuple[InstanceState, ...]:
        """Every instance of workers serving `model`, in registration order, available or not."""
        return self.view(model).instances

"""The worker registry: registered workers, each carrying dp_size selectable instances (base id, rank).

Pure bookkeeping: no sockets. The HTTP handlers and the health checker call into it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass(frozen=True, order=True)
class InstanceId:
    base_worker_id: str
    dp_rank: int


@dataclass
class Worker:
    worker_id: str
    url: str
    models: list[str]
    labels: dict[str, str]
    dp_size: int = 1
    connection_mode: str = "grpc"
    max_context_length: int = 0
    kv_block_size: int = 0
    healthy: bool = True
    weight_version: int = 0

    @property
    def target(self) -> str:
        """host:port for a gRPC channel."""
        return urlsplit(self.url).netloc

    def instances(self) -> list[InstanceId]:
        return [InstanceId(self.worker_id, rank) for rank in range(self.dp_size)]

    def serves(self, model: str | None) -> bool:
        return model is None or model in self.models

    def to_json(self) -> dict:
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
            "weight_version": self.weight_version,
            "instances": [{"base_worker_id": i.base_worker_id, "dp_rank": i.dp_rank} for i in self.instances()],
        }


@dataclass(frozen=True)
class Instance:
    """A selectable target: one data-parallel rank of a registered worker."""

    id: InstanceId
    worker: Worker


@dataclass
class WorkerRegistry:
    _workers: dict[str, Worker] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(0))

    def new_id(self) -> str:
        while True:
            candidate = str(next(self._ids))
            if candidate not in self._workers:
                return candidate

    def by_url(self, url: str) -> Worker | None:
        return next((w for w in self._workers.values() if w.url == url), None)

    def add(self, worker: Worker) -> Worker:
        self._workers[worker.worker_id] = worker
        return worker

    def remove(self, worker_id: str) -> Worker | None:
        return self._workers.pop(worker_id, None)

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for w in self._workers.values():
            for m in w.models:
                seen.setdefault(m)
        return list(seen)

    def candidates(self, model: str | None) -> list[Instance]:
        """Healthy instances of workers that serve `model` (None: any model), in registration order."""
        return [
            Instance(iid, w) for w in self._workers.values() if w.healthy and w.serves(model) for iid in w.instances()
        ]

    def serving(self, model: str | None) -> Iterable[Worker]:
        return (w for w in self._workers.values() if w.serves(model))

"""The router's background loops: health checks, load polling, KV-event subscriptions, prefix-tree eviction."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime

import grpc

from psrl.router.config import ConnectionMode
from psrl.router.http_backend import HttpWorkers
from psrl.router.policies.kv_index import KvEventIndex
from psrl.router.registry import SchedulerStats, Worker, WorkerRegistry
from psrl.router.worker_client import WorkerClients

logger = logging.getLogger(__name__)


async def _every(interval_s: float, body: Callable[[], Awaitable[None]]) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await body()
        except asyncio.CancelledError:
            raise
        except Exception:  # a failed round must not end the loop; it is logged and retried next interval
            logger.exception("background round failed")


class BackgroundLoops:
    def __init__(
        self,
        registry: WorkerRegistry,
        clients: WorkerClients,
        http: HttpWorkers,
        *,
        health_interval_s: float,
        health_timeout_s: float,
        load_poll_interval_s: float,
        kv_index: KvEventIndex | None,
        evict: Callable[[float], object],
    ) -> None:
        self._registry = registry
        self._clients = clients
        self._http = http
        self._health_interval_s = health_interval_s
        self._health_timeout_s = health_timeout_s
        self._load_poll_interval_s = load_poll_interval_s
        self._kv_index = kv_index
        self._evict = evict
        self._tasks: list[asyncio.Task] = []
        self._subscriptions: dict[str, asyncio.Task] = {}

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(_every(self._health_interval_s, self.check_health)))
        if self._load_poll_interval_s > 0:
            self._tasks.append(asyncio.create_task(_every(self._load_poll_interval_s, self.poll_loads)))

        async def _evict_round() -> None:
            self._evict(time.monotonic())

        self._tasks.append(asyncio.create_task(_every(5.0, _evict_round)))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._subscriptions.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._subscriptions.clear()

    # ---- health ---------------------------------------------------------------------------------------

    async def _probe(self, worker: Worker) -> bool:
        if worker.connection_mode is ConnectionMode.HTTP:
            return await self._http.is_healthy(worker, self._health_timeout_s)
        return await self._clients.is_healthy(worker, self._health_timeout_s)

    async def check_health(self) -> None:
        workers = self._registry.workers()
        results = await asyncio.gather(*(self._probe(w) for w in workers), return_exceptions=True)
        for worker, result in zip(workers, results):
            if isinstance(result, BaseException):  # a probe's bug fails that worker's check, not the round
                logger.warning("health check of worker %s failed: %r", worker.worker_id, result)
            passed = result is True
            if worker.health.record(passed):
                logger.warning(
                    "worker %s (%s) is now %s",
                    worker.worker_id,
                    worker.url,
                    "healthy" if worker.healthy else "unhealthy",
                )

    # ---- loads ----------------------------------------------------------------------------------------

    async def poll_loads(self) -> None:
        workers = [w for w in self._registry.workers() if w.connection_mode is ConnectionMode.GRPC and w.healthy]
        replies = await asyncio.gather(
            *(self._clients.loads(w, self._health_timeout_s) for w in workers), return_exceptions=True
        )
        for worker, reply in zip(workers, replies):
            if isinstance(reply, BaseException):
                continue  # the health loop judges reachability; a missed poll keeps the last figures
            try:
                ts = datetime.fromisoformat(reply.timestamp.replace("Z", "+00:00")).timestamp()
            except ValueError:
                ts = time.time()
            for load in reply.loads:
                inst = worker.instance(load.dp_rank)
                if inst is None or ts < inst.stats.timestamp:
                    continue  # a coordinator push newer than this poll wins
                inst.stats = SchedulerStats(
                    num_running_reqs=load.num_running_reqs,
                    num_waiting_reqs=load.num_waiting_reqs,
                    kv_cache_usage=load.token_usage,
                    timestamp=ts,
                )

    # ---- KV events ------------------------------------------------------------------------------------

    def watch_worker(self, worker: Worker) -> None:
        """Subscribe to a gRPC worker's KV events (cache_aware_v1); resubscribes after failures."""
        if self._kv_index is None or worker.connection_mode is not ConnectionMode.GRPC:
            return
        self.forget_worker(worker.worker_id)
        self._subscriptions[worker.worker_id] = asyncio.create_task(self._subscribe(worker))

    def forget_worker(self, worker_id: str) -> None:
        task = self._subscriptions.pop(worker_id, None)
        if task is not None:
            task.cancel()
        if self._kv_index is not None:
            self._kv_index.remove_worker(worker_id)

    async def _subscribe(self, worker: Worker) -> None:
        assert self._kv_index is not None
        backoff = 0.2
        while True:
            try:
                async for batch in self._clients.kv_events(worker):
                    backoff = 0.2
                    rank = batch.dp_rank if batch.HasField("dp_rank") else 0
                    inst = worker.instance(rank)
                    if inst is not None:
                        self._kv_index.apply(inst.id, batch)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    logger.info(
                        "worker %s publishes no KV events; cache_aware_v1 uses its token tree", worker.worker_id
                    )
                    return
                logger.debug("KV event stream of %s ended: %s", worker.worker_id, e.code())
            # The stream restarts from a fresh snapshot, so the worker's old state is dropped first.
            self._kv_index.remove_worker(worker.worker_id)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

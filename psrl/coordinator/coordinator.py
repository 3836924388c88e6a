"""The weight-sync protocol against the router (HTTP) and the replicas (gRPC ReplicaControl).

  1. pause the routing loop and wait for its barrier (no new Generate reaches a replica after it)
  2. pause every replica for the sync (running requests end with an abort frame carrying their tokens)
  3. wait until the router has taken every interrupted request back (they wait in its queue)
  4. load the new weights on every replica
  5. publish the version for every rank (/workers/update_weight_version)
  6. resume the replicas, then the routing loop (in this order, so no dispatch meets a closed replica)

A replica whose call fails, or whose version update the router rejects, is marked failed (FailSync) and paused
in the router (/workers/pause); the others go on, and the loop resumes so they keep serving. When the sync itself
aborts (a router call fails, the loop-back times out, the caller cancels), the replicas that may hold weights the
router has not published are failed the same way and the others resume on the weights they had. Cleanup never
replaces the error that ended the sync: what fails in it is logged and added to that error as a note.

The coordinator calls each replica at the gRPC address it registered with the router (GET /workers), so the
trainer must reach every replica's gRPC port, and it needs grpcio and the protobuf stubs (the full install; the
`[client]` one has httpx and numpy only). `push_stats` feeds the router's least-load/psrl view with the
replicas' scheduler stats (/workers/update_stats).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import grpc
import httpx
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl._proto import replica_control_pb2 as rc
from psrl._proto import replica_control_pb2_grpc as rc_grpc
from psrl.credentials import load_replica_token
from psrl.replica_auth import token_interceptors
from psrl.session.config import ThunderConfig
from psrl.session.thunder import Plan
from psrl.session.thunder_driver import HttpSessions, ReadError, ThunderDriver, ThunderMetrics

logger = logging.getLogger(__name__)
T = TypeVar("T")


class SyncError(RuntimeError):
    """A sync or a router call failed. `failed` names the replicas taken out of rotation, `reasons` why each
    failed. A router call fails as one too (a transport error, an error status, an answer that is not a JSON
    object), with httpx's or the JSON decoder's error, where there is one, as its `__cause__`."""

    def __init__(self, message: str, failed: Sequence[str] = (), reasons: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.failed = list(failed)
        self.reasons = dict(reasons or {})


def _failure_reason(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            return (
                "it does not serve psrl.control.ReplicaControl (a stock vLLM servicer? start it as "
                "`python -m psrl.worker --engine vllm`)"
            )
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


def _record_failure(failed: dict[ReplicaHandle, str], replica: ReplicaHandle, reason: str) -> None:
    logger.error("replica %s failed during the sync: %s", replica.worker_id, reason)
    failed.setdefault(replica, reason)


@dataclass(frozen=True)
class ReplicaHandle:
    worker_id: str
    target: str  # host:port of its gRPC server (VllmEngine + ReplicaControl)
    dp_size: int


@dataclass
class SyncReport:
    version: int
    replicas: list[str]
    aborted_requests: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)


class RolloutCoordinator:
    """Async client. Use `async with RolloutCoordinator(url) as c: await c.sync_weights(...)`."""

    def __init__(
        self,
        router_url: str,
        *,
        admin_api_key: str | None = None,
        replica_token: str | None = None,
        rpc_timeout_s: float = 120.0,
        loopback_timeout_s: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`replica_token`: what tokened replicas require on their control calls (default: the environment's
        PSRL_REPLICA_TOKEN, as the router and the replicas read it). `transport`: httpx's transport to the router
        (default: plain HTTP)."""
        self._interceptors = token_interceptors(replica_token or load_replica_token())
        headers = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}
        self._http = httpx.AsyncClient(
            base_url=router_url.rstrip("/"), headers=headers, timeout=rpc_timeout_s, transport=transport
        )
        self._rpc_timeout_s = rpc_timeout_s
        self._loopback_timeout_s = loopback_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def __aenter__(self) -> RolloutCoordinator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # ---- plumbing ---------------------------------------------------------------------------------------

    def _channel(self, target: str) -> grpc.aio.Channel:
        if target not in self._channels:
            self._channels[target] = grpc.aio.insecure_channel(target, interceptors=self._interceptors)
        return self._channels[target]

    def _control(self, replica: ReplicaHandle) -> rc_grpc.ReplicaControlStub:
        return rc_grpc.ReplicaControlStub(self._channel(replica.target))

    async def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """The router's JSON object for one call; a transport error, an error status or any other answer is a
        SyncError."""
        try:
            resp = await self._http.request(method, path, json=body)
            resp.raise_for_status()
            answer = resp.json()
        except httpx.HTTPStatusError as e:
            raise SyncError(
                f"{method} {path}: the router answered {e.response.status_code}: {e.response.text:.500}"
            ) from e
        except httpx.HTTPError as e:
            raise SyncError(f"{method} {path} failed: {type(e).__name__}: {e}") from e
        except ValueError as e:  # the body is not JSON
            raise SyncError(f"{method} {path}: the router's answer is not JSON: {e}") from e
        if not isinstance(answer, dict):
            raise SyncError(f"{method} {path}: the router's answer is not a JSON object: {answer!r:.200}")
        return answer

    async def replicas(self) -> list[ReplicaHandle]:
        listing = await self._call("GET", "/workers")
        try:
            return [
                ReplicaHandle(w["worker_id"], w["url"].removeprefix("grpc://"), int(w["dp_size"]))
                for w in listing["workers"]
                if w.get("connection_mode", "grpc") == "grpc"
            ]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SyncError(f"GET /workers: the router's worker list is malformed ({type(e).__name__}: {e})") from e

    # ---- the routing loop --------------------------------------------------------------------------------

    async def pause_routing(self) -> dict[str, Any]:
        status = await self._call("POST", "/routing_loop/pause?wait=true", {})
        if status.get("enabled") and (
            not status.get("paused") or status.get("selecting") or status.get("active_dispatch_handoffs")
        ):
            raise SyncError(f"routing loop did not reach its pause barrier: {status}")
        return status

    async def resume_routing(self) -> dict[str, Any]:
        return await self._call("POST", "/routing_loop/resume", {})

    async def _wait_looped_back(self, replicas: Sequence[ReplicaHandle], failed: dict[ReplicaHandle, str]) -> None:
        """Every interrupted request has come back to the router (none runs anywhere). A replica whose
        GetSyncState fails joins `failed`."""
        deadline = asyncio.get_running_loop().time() + self._loopback_timeout_s
        while True:
            status = await self._call("GET", "/routing_loop/status")
            states = await self._each(
                [r for r in replicas if r not in failed],
                lambda r: self._control(r).GetSyncState(rc.GetSyncStateRequest(), timeout=self._rpc_timeout_s),
                failed,
            )
            if status.get("running_request_num", 0) == 0 and all(s is None or s.running_requests == 0 for s in states):
                return
            if asyncio.get_running_loop().time() > deadline:
                raise SyncError(f"interrupted requests did not loop back within {self._loopback_timeout_s}s")
            await asyncio.sleep(0.02)

    # ---- the sync ----------------------------------------------------------------------------------------

    async def sync_weights(
        self,
        version: int,
        *,
        seed: int | None = None,
        path: str | None = None,
        replicas: Sequence[ReplicaHandle] | None = None,
    ) -> SyncReport:
        if (seed is None) == (path is None):
            raise ValueError("give exactly one weight source: seed or path")
        loop = asyncio.get_running_loop()
        start = loop.time()
        phases: dict[str, float] = {}
        targets = list(replicas) if replicas is not None else await self.replicas()
        if not targets:
            raise SyncError("no gRPC replicas are registered")

        def mark(name: str, since: float) -> float:
            now = loop.time()
            phases[name] = now - since
            return now

        t = start
        aborted = 0
        failed: dict[ReplicaHandle, str] = {}  # replica -> why it failed, in the order they failed
        paused: list[ReplicaHandle] = []  # the replicas told to pause (all of them, from step 2 on)
        unpublished = False  # from step 4 until step 5 succeeds: replicas may hold weights the router doesn't know
        try:
            await self.pause_routing()
            t = mark("pause_routing", t)
            paused = targets
            pauses = await self._each(
                targets,
                lambda r: self._control(r).PauseGeneration(
                    rc.PauseGenerationRequest(mode=rc.PAUSE_MODE_ABORT), timeout=self._rpc_timeout_s
                ),
                failed,
            )
            aborted = sum(len(p.aborted_request_ids) for p in pauses if p is not None)
            t = mark("pause_replicas", t)
            await self._wait_looped_back(targets, failed)
            t = mark("loop_back", t)
            source = {"seed": seed} if seed is not None else {"path": path}
            unpublished = True
            await self._each(
                [r for r in targets if r not in failed],
                lambda r: self._control(r).LoadWeights(
                    rc.LoadWeightsRequest(version=version, **source), timeout=self._rpc_timeout_s
                ),
                failed,
            )
            t = mark("load_weights", t)
            live = [r for r in targets if r not in failed]
            updates = [
                {"worker_id": r.worker_id, "dp_rank": rank, "weight_version": version}
                for r in live
                for rank in range(r.dp_size)
            ]
            if updates:
                answer = await self._call("POST", "/workers/update_weight_version", updates)
                for replica, why in _rejected_updates(answer, live).items():
                    _record_failure(failed, replica, why)
            unpublished = False
            t = mark("publish_version", t)
            await self._each(
                [r for r in targets if r not in failed],
                lambda r: self._control(r).ResumeGeneration(rc.ResumeGenerationRequest(), timeout=self._rpc_timeout_s),
                failed,
            )
            t = mark("resume_replicas", t)
        except BaseException as error:
            resume = [r for r in paused if r not in failed]
            if unpublished:  # they cannot serve: the router would tag their tokens with the old version
                for replica in resume:
                    failed[replica] = (
                        f"the sync aborted before version {version} was published ({_failure_reason(error)})"
                    )
                resume = []
            await self._clean_up(error, failed, resume)
            if isinstance(error, SyncError) and failed:
                error.failed = [r.worker_id for r in failed]
                error.reasons = {r.worker_id: why for r, why in failed.items()}
            raise
        if failed:
            reasons = {r.worker_id: why for r, why in failed.items()}
            detail = "; ".join(f"{wid}: {why}" for wid, why in reasons.items())
            failure = SyncError(
                f"sync to version {version} failed on {list(reasons)}: {detail}", list(reasons), reasons
            )
            await self._clean_up(failure, failed, [])
            raise failure
        await self.resume_routing()
        mark("resume_routing", t)
        return SyncReport(version, [r.worker_id for r in targets], aborted, loop.time() - start, phases)

    async def _each(
        self,
        replicas: Sequence[ReplicaHandle],
        rpc: Callable[[ReplicaHandle], Awaitable[Any]],
        failed: dict[ReplicaHandle, str],
    ) -> list[Any]:
        """Run an RPC on every replica at once; a replica whose call fails joins `failed`, with the reason."""
        results = await asyncio.gather(*(rpc(r) for r in replicas), return_exceptions=True)
        out: list[Any] = []
        for replica, result in zip(replicas, results):
            if isinstance(result, BaseException):
                _record_failure(failed, replica, _failure_reason(result))
                out.append(None)
            else:
                out.append(result)
        return out

    async def _clean_up(
        self, error: BaseException, failed: dict[ReplicaHandle, str], resume: Sequence[ReplicaHandle]
    ) -> None:
        """After a failed sync: resume `resume` (one that fails joins `failed`), take `failed` out of rotation and
        resume the routing loop. Every step is tried; one that fails is logged and noted on `error`, which stays
        the error the caller raises."""
        if resume:
            await self._each(
                resume,
                lambda r: self._control(r).ResumeGeneration(rc.ResumeGenerationRequest(), timeout=self._rpc_timeout_s),
                failed,
            )
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = []
        if failed:
            steps.append(("take the failed replicas out of rotation", lambda: self._fail(failed)))
        steps.append(("resume the routing loop", self.resume_routing))
        for what, step in steps:
            try:
                await step()
            except Exception as e:
                logger.error("after the failed sync, could not %s: %s", what, e)
                error.add_note(f"cleanup could not {what}: {e}")

    async def _fail(self, reasons: dict[ReplicaHandle, str]) -> None:
        """Keep failed replicas out of rotation: FailSync on them (best effort) and /workers/pause."""
        await asyncio.gather(
            *(self._control(r).FailSync(rc.FailSyncRequest(reason=why), timeout=5.0) for r, why in reasons.items()),
            return_exceptions=True,
        )
        answer = await self._call("POST", "/workers/pause", [{"base_worker_id": r.worker_id} for r in reasons])
        if answer.get("rejected"):
            raise SyncError(f"the router did not pause every failed replica: {answer.get('results')}")

    # ---- stats --------------------------------------------------------------------------------------------

    async def push_stats(self, replicas: Sequence[ReplicaHandle] | None = None) -> dict[str, Any]:
        """One round: each replica's GetLoads per rank, pushed to /workers/update_stats."""
        targets = list(replicas) if replicas is not None else await self.replicas()
        entries = []
        for replica in targets:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(self._channel(replica.target))
            try:
                loads = await stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=self._rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                logger.warning("no loads from %s: %s", replica.worker_id, e.code())
                continue
            now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
            for load in loads.loads:
                entries.append(
                    {
                        "worker_id": replica.worker_id,
                        "dp_rank": load.dp_rank,
                        "timestamp": now,
                        "scheduler_stats": {
                            "num_running_reqs": load.num_running_reqs,
                            "num_waiting_reqs": load.num_waiting_reqs,
                            "kv_cache_usage": load.token_usage,
                        },
                    }
                )
        if not entries:
            return {"total": 0, "updated": 0, "rejected": 0, "stale_ignored": 0, "results": []}
        return await self._call("POST", "/workers/update_stats", entries)

    # ---- the session strategy -------------------------------------------------------------------------------

    def session_strategy(
        self,
        session_router_url: str,
        config: ThunderConfig | None = None,
        *,
        session_admin_api_key: str | None = None,
        metrics: ThunderMetrics | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> ThunderDriver:
        """The thunder_agent strategy driven from here, for a SessionRouter started without it: each round reads
        the instances from this coordinator's router and the sessions from the SessionRouter's control API
        (`session_admin_api_key`: its --admin-api-key), and hangs and continues sessions there. The same rounds
        as `--session-strategy thunder_agent`. `await driver.step()` runs one round, `driver.start()` runs them
        every `config.check_interval_ms` until `await driver.aclose()` (which also closes its client)."""
        headers = {"Authorization": f"Bearer {session_admin_api_key}"} if session_admin_api_key else {}
        client = httpx.AsyncClient(
            base_url=session_router_url.rstrip("/"), headers=headers, timeout=self._rpc_timeout_s, transport=transport
        )
        return ThunderDriver(config or ThunderConfig(), self._router_json, HttpSessions(client), metrics)

    async def _router_json(self, path: str) -> dict[str, Any]:
        try:
            return await self._call("GET", path)
        except SyncError as e:
            raise ReadError(str(e)) from e

    async def push_stats_forever(self, interval_s: float = 0.5) -> None:
        """Run until cancelled (PSRL's coordinator_sync_interval_in_ms)."""
        while True:
            try:
                await self.push_stats()
            except (SyncError, grpc.aio.AioRpcError) as e:
                logger.warning("stats push failed: %s", e)
            await asyncio.sleep(interval_s)


class BlockingRolloutCoordinator:
    """RolloutCoordinator's calls for plain (non-asyncio) training code, run on its own event loop in a thread."""

    def __init__(
        self,
        router_url: str,
        *,
        admin_api_key: str | None = None,
        replica_token: str | None = None,
        rpc_timeout_s: float = 120.0,
        loopback_timeout_s: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="psrl-coordinator", daemon=True)
        self._thread.start()

        async def make() -> RolloutCoordinator:  # on the loop that will run its calls
            return RolloutCoordinator(
                router_url,
                admin_api_key=admin_api_key,
                replica_token=replica_token,
                rpc_timeout_s=rpc_timeout_s,
                loopback_timeout_s=loopback_timeout_s,
                transport=transport,
            )

        self._inner = self._run(make())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def sync_weights(
        self,
        version: int,
        *,
        seed: int | None = None,
        path: str | None = None,
        replicas: Sequence[ReplicaHandle] | None = None,
    ) -> SyncReport:
        return self._run(self._inner.sync_weights(version, seed=seed, path=path, replicas=replicas))

    def push_stats(self, replicas: Sequence[ReplicaHandle] | None = None) -> dict[str, Any]:
        return self._run(self._inner.push_stats(replicas))

    def replicas(self) -> list[ReplicaHandle]:
        return self._run(self._inner.replicas())

    def pause_routing(self) -> dict[str, Any]:
        return self._run(self._inner.pause_routing())

    def resume_routing(self) -> dict[str, Any]:
        return self._run(self._inner.resume_routing())

    def session_strategy(
        self,
        session_router_url: str,
        config: ThunderConfig | None = None,
        *,
        session_admin_api_key: str | None = None,
        metrics: ThunderMetrics | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> BlockingSessionStrategy:
        """RolloutCoordinator.session_strategy, its rounds run on this client's event loop."""

        async def make() -> ThunderDriver:
            return self._inner.session_strategy(
                session_router_url,
                config,
                session_admin_api_key=session_admin_api_key,
                metrics=metrics,
                transport=transport,
            )

        return BlockingSessionStrategy(self._run(make()), self._run)

    def close(self) -> None:
        self._run(self._inner.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> BlockingRolloutCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlockingSessionStrategy:
    """A ThunderDriver for plain training code: `step()` runs one round, `start()` runs them in the background
    until `close()`."""

    def __init__(self, driver: ThunderDriver, run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
        self.driver = driver
        self._run = run

    def step(self) -> Plan:
        return self._run(self.driver.step())

    def start(self) -> None:
        async def start() -> None:
            self.driver.start()

        self._run(start())

    def close(self) -> None:
        self._run(self.driver.aclose())


def _rejected_updates(answer: dict[str, Any], replicas: Sequence[ReplicaHandle]) -> dict[ReplicaHandle, str]:
    """The replicas whose version update the router did not take (a replica's ranks are taken together or not
    at all), each with the router's reason."""
    results = answer.get("results")
    if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
        raise SyncError(f"POST /workers/update_weight_version: no per-update results in {answer!r:.300}")
    taken = Counter(r.get("worker_id") for r in results if r.get("status") == "updated")
    why = {r.get("worker_id"): r.get("reason") for r in results if r.get("status") != "updated"}
    return {
        r: f"the router rejected its version update: {why.get(r.worker_id) or 'no result for it'}"
        for r in replicas
        if taken[r.worker_id] != r.dp_size
    }

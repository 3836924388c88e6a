"""The coordinator's failure paths, against a mock router (httpx.MockTransport) and fake ReplicaControl servers
in this process: a real router or replica cannot be made to fail a given call on demand."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest
from grpc.aio import AioRpcError, Metadata

from psrl._proto import replica_control_pb2 as rc
from psrl._proto import replica_control_pb2_grpc as rc_grpc
from psrl.coordinator import BlockingRolloutCoordinator, ReplicaHandle, RolloutCoordinator, SyncError
from psrl.coordinator.coordinator import _failure_reason

ROUTER = "http://router.test"
Answer = Callable[[httpx.Request], httpx.Response]


class FakeReplica(rc_grpc.ReplicaControlServicer):
    """ReplicaControl that records its calls and fails (or holds) the ones a test names."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.calls: list[str] = []
        self.fail: dict[str, grpc.StatusCode] = {}
        self.hold: dict[str, asyncio.Event] = {}  # a call waits for its event
        self.entered: dict[str, asyncio.Event] = {}  # set once a held call arrived
        self.paused = False
        self.fail_reason: str | None = None
        self.handle: ReplicaHandle | None = None

    async def _enter(self, name: str, context: grpc.aio.ServicerContext) -> None:
        self.calls.append(name)
        if name in self.hold:
            self.entered.setdefault(name, asyncio.Event()).set()
            await self.hold[name].wait()
        if name in self.fail:
            await context.abort(self.fail[name], f"{name} failed on purpose")

    async def PauseGeneration(self, request, context):  # type: ignore[no-untyped-def]
        await self._enter("PauseGeneration", context)
        self.paused = True
        return rc.PauseGenerationResponse(aborted_request_ids=["r1"], paused=True)

    async def GetSyncState(self, request, context):  # type: ignore[no-untyped-def]
        await self._enter("GetSyncState", context)
        return rc.GetSyncStateResponse(paused=self.paused, running_requests=0)

    async def LoadWeights(self, request, context):  # type: ignore[no-untyped-def]
        await self._enter("LoadWeights", context)
        return rc.LoadWeightsResponse(weight_version=request.version)

    async def ResumeGeneration(self, request, context):  # type: ignore[no-untyped-def]
        await self._enter("ResumeGeneration", context)
        self.paused = False
        return rc.ResumeGenerationResponse(paused=False)

    async def FailSync(self, request, context):  # type: ignore[no-untyped-def]
        await self._enter("FailSync", context)
        self.fail_reason = request.reason
        return rc.FailSyncResponse()


@dataclass
class FakeRouter:
    """The router's admin endpoints the coordinator calls, answering as the real one does unless a test
    overrides a route with `answers[(method, path)]`."""

    replicas: list[FakeReplica]
    answers: dict[tuple[str, str], Answer] = field(default_factory=dict)
    calls: list[tuple[str, str, Any]] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.calls.append((request.method, request.url.path, body))
        key = (request.method, request.url.path)
        if key in self.answers:
            return self.answers[key](request)
        if key == ("GET", "/workers"):
            workers = [
                {"worker_id": r.worker_id, "url": f"grpc://{r.handle.target}", "dp_size": 1}
                for r in self.replicas
                if r.handle is not None
            ]
            return httpx.Response(200, json={"workers": workers})
        if key in (("POST", "/routing_loop/pause"), ("POST", "/routing_loop/resume"), ("GET", "/routing_loop/status")):
            paused = request.url.path.endswith("/pause")
            return httpx.Response(
                200, json={"enabled": True, "paused": paused, "selecting": False, "active_dispatch_handoffs": 0}
            )
        if key == ("POST", "/workers/update_weight_version"):
            results = [{"worker_id": u["worker_id"], "status": "updated"} for u in body]
            return httpx.Response(
                200, json={"total": len(results), "updated": len(results), "rejected": 0, "results": results}
            )
        if key == ("POST", "/workers/pause"):
            results = [{"base_worker_id": w["base_worker_id"], "status": "updated"} for w in body]
            return httpx.Response(200, json={"updated": len(results), "rejected": 0, "results": results})
        return httpx.Response(404, json={"error": f"no route {key}"})

    def bodies(self, method: str, path: str) -> list[Any]:
        return [body for m, p, body in self.calls if (m, p) == (method, path)]


@dataclass
class Fleet:
    router: FakeRouter
    a: FakeReplica
    b: FakeReplica

    def coordinator(self, **kwargs: Any) -> RolloutCoordinator:
        return RolloutCoordinator(ROUTER, transport=httpx.MockTransport(self.router), **kwargs)


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    replicas = [FakeReplica("a"), FakeReplica("b")]
    servers = []
    for replica in replicas:
        server = grpc.aio.server()
        rc_grpc.add_ReplicaControlServicer_to_server(replica, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        replica.handle = ReplicaHandle(replica.worker_id, f"127.0.0.1:{port}", 1)
        servers.append(server)
    yield Fleet(FakeRouter(replicas), *replicas)
    for server in servers:
        await server.stop(None)


def _status(code: int, **body: Any) -> Answer:
    return lambda request: httpx.Response(code, json=body)


def _resumed_routing(router: FakeRouter) -> bool:
    return router.calls[-1][:2] == ("POST", "/routing_loop/resume")


async def test_a_clean_sync_publishes_every_replica(fleet: Fleet) -> None:
    async with fleet.coordinator() as coordinator:
        report = await coordinator.sync_weights(3, seed=3)
    assert report.replicas == ["a", "b"] and report.aborted_requests == 2
    for replica in (fleet.a, fleet.b):
        assert replica.calls == ["PauseGeneration", "GetSyncState", "LoadWeights", "ResumeGeneration"]
    assert fleet.router.bodies("POST", "/workers/update_weight_version") == [
        [{"worker_id": w, "dp_rank": 0, "weight_version": 3} for w in ("a", "b")]
    ]
    assert not fleet.router.bodies("POST", "/workers/pause") and _resumed_routing(fleet.router)


@pytest.mark.parametrize("call", ["PauseGeneration", "GetSyncState", "LoadWeights", "ResumeGeneration"])
async def test_a_replica_whose_call_fails_is_the_only_one_taken_out(fleet: Fleet, call: str) -> None:
    fleet.b.fail[call] = grpc.StatusCode.UNAVAILABLE
    async with fleet.coordinator() as coordinator:
        with pytest.raises(SyncError) as err:
            await coordinator.sync_weights(3, seed=3)
    assert err.value.failed == ["b"] and err.value.reasons["b"] == f"UNAVAILABLE: {call} failed on purpose"
    assert fleet.b.fail_reason == err.value.reasons["b"] and fleet.a.fail_reason is None
    assert fleet.router.bodies("POST", "/workers/pause") == [[{"base_worker_id": "b"}]]
    assert fleet.a.calls[-1] == "ResumeGeneration" and not fleet.a.paused
    (published,) = fleet.router.bodies("POST", "/workers/update_weight_version")
    assert [u["worker_id"] for u in published] == (["a", "b"] if call == "ResumeGeneration" else ["a"])
    assert _resumed_routing(fleet.router)


def _refuse(code: int) -> Answer:
    return lambda request: httpx.Response(code, json={"error": {"message": "no"}})


def _text(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, text="<html>proxy</html>")


def _list(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=[])


def _unreachable(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        (_refuse(401), httpx.HTTPStatusError),
        (_refuse(500), httpx.HTTPStatusError),
        (_text, json.JSONDecodeError),
        (_list, type(None)),
        (_unreachable, httpx.ConnectError),
    ],
    ids=["401", "500", "not-json", "not-an-object", "unreachable"],
)
async def test_a_loop_status_that_fails_is_not_read_as_drained(fleet: Fleet, answer: Answer, cause: type) -> None:
    fleet.router.answers[("GET", "/routing_loop/status")] = answer
    async with fleet.coordinator() as coordinator:
        with pytest.raises(SyncError, match="/routing_loop/status") as err:
            await coordinator.sync_weights(3, seed=3)
    assert type(err.value.__cause__) is cause and err.value.failed == []
    for replica in (fleet.a, fleet.b):  # nothing loaded: they serve on at the weights they had
        assert "LoadWeights" not in replica.calls and replica.calls[-1] == "ResumeGeneration"
        assert replica.fail_reason is None
    assert not fleet.router.bodies("POST", "/workers/pause") and _resumed_routing(fleet.router)


async def test_requests_that_do_not_loop_back_end_the_sync(fleet: Fleet) -> None:
    fleet.router.answers[("GET", "/routing_loop/status")] = _status(200, enabled=True, running_request_num=3)
    async with fleet.coordinator(loopback_timeout_s=0) as coordinator:
        with pytest.raises(SyncError, match="did not loop back"):
            await coordinator.sync_weights(3, seed=3)
    assert all("LoadWeights" not in r.calls and not r.paused for r in (fleet.a, fleet.b))
    assert not fleet.router.bodies("POST", "/workers/pause") and _resumed_routing(fleet.router)


async def test_a_failed_version_update_takes_out_the_replicas_that_loaded(fleet: Fleet) -> None:
    fleet.router.answers[("POST", "/workers/update_weight_version")] = _refuse(500)
    async with fleet.coordinator() as coordinator:
        with pytest.raises(SyncError, match="update_weight_version") as err:
            await coordinator.sync_weights(3, seed=3)
    assert isinstance(err.value.__cause__, httpx.HTTPStatusError)
    assert err.value.failed == ["a", "b"] and "before version 3 was published" in err.value.reasons["a"]
    assert all("ResumeGeneration" not in r.calls and r.fail_reason for r in (fleet.a, fleet.b))
    assert fleet.router.bodies("POST", "/workers/pause") == [[{"base_worker_id": "a"}, {"base_worker_id": "b"}]]
    assert _resumed_routing(fleet.router)


async def test_a_rejected_version_update_takes_out_that_replica_only(fleet: Fleet) -> None:
    results = [
        {"worker_id": "a", "status": "updated"},
        {"worker_id": "b", "status": "rejected", "reason": "unknown worker"},
    ]
    fleet.router.answers[("POST", "/workers/update_weight_version")] = _status(
        200, total=2, updated=1, rejected=1, results=results
    )
    async with fleet.coordinator() as coordinator:
        with pytest.raises(SyncError) as err:
            await coordinator.sync_weights(3, seed=3)
    assert err.value.failed == ["b"] and "unknown worker" in err.value.reasons["b"]
    assert fleet.router.bodies("POST", "/workers/pause") == [[{"base_worker_id": "b"}]]
    assert not fleet.a.paused and "ResumeGeneration" not in fleet.b.calls


async def test_a_routing_loop_that_does_not_pause_touches_no_replica(fleet: Fleet) -> None:
    fleet.router.answers[("POST", "/routing_loop/pause")] = _status(200, enabled=True, paused=False)
    async with fleet.coordinator() as coordinator:
        with pytest.raises(SyncError, match="pause barrier"):
            await coordinator.sync_weights(3, seed=3)
    assert fleet.a.calls == fleet.b.calls == [] and _resumed_routing(fleet.router)


async def test_a_failing_cleanup_never_hides_the_error(fleet: Fleet) -> None:
    fleet.router.answers[("GET", "/routing_loop/status")] = _refuse(401)
    fleet.router.answers[("POST", "/routing_loop/resume")] = _unreachable
    async with fleet.coordinator() as coordinator:
        with pytest.raises(SyncError, match="routing_loop/status: the router answered 401") as err:
            await coordinator.sync_weights(3, seed=3)
    assert isinstance(err.value.__cause__, httpx.HTTPStatusError)
    (note,) = err.value.__notes__
    assert "could not resume the routing loop" in note and "ConnectError" in note


async def test_a_failed_pause_of_failed_replicas_is_noted_and_routing_resumes(fleet: Fleet) -> None:
    fleet.b.fail["LoadWeights"] = grpc.StatusCode.INVALID_ARGUMENT
    fleet.router.answers[("POST", "/workers/pause")] = _refuse(500)
    async with fleet.coordinator() as coordinator:
        with pytest.raises(SyncError) as err:
            await coordinator.sync_weights(3, seed=3)
    assert err.value.failed == ["b"] and "LoadWeights failed on purpose" in str(err.value)
    (note,) = err.value.__notes__
    assert "take the failed replicas out of rotation" in note and "500" in note
    assert _resumed_routing(fleet.router)


async def test_a_cancelled_sync_takes_out_the_replicas_that_may_have_loaded(fleet: Fleet) -> None:
    fleet.a.hold["LoadWeights"] = asyncio.Event()  # never set: the sync is cancelled while a loads
    async with fleet.coordinator() as coordinator:
        sync = asyncio.ensure_future(coordinator.sync_weights(3, seed=3))
        await fleet.a.entered.setdefault("LoadWeights", asyncio.Event()).wait()
        sync.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sync
    assert fleet.a.fail_reason and fleet.b.fail_reason and "CancelledError" in fleet.a.fail_reason
    assert fleet.router.bodies("POST", "/workers/pause") == [[{"base_worker_id": "a"}, {"base_worker_id": "b"}]]
    assert not fleet.router.bodies("POST", "/workers/update_weight_version") and _resumed_routing(fleet.router)


@pytest.mark.parametrize(
    "answer",
    [_unreachable, _refuse(403), _status(200, workers=[{"worker_id": "a"}])],
    ids=["unreachable", "403", "malformed"],
)
async def test_a_worker_list_that_fails_is_a_sync_error(fleet: Fleet, answer: Answer) -> None:
    fleet.router.answers[("GET", "/workers")] = answer
    async with fleet.coordinator() as coordinator:
        with pytest.raises(SyncError, match="/workers") as err:
            await coordinator.sync_weights(3, seed=3)
    assert err.value.__cause__ is not None and fleet.router.calls == [("GET", "/workers", None)]


def test_the_blocking_client_raises_what_the_async_one_does() -> None:
    router = FakeRouter([])
    router.answers[("POST", "/routing_loop/pause")] = _refuse(401)
    replica = ReplicaHandle("a", "127.0.0.1:1", 1)  # never called: the sync stops before any replica call
    with (
        BlockingRolloutCoordinator(ROUTER, transport=httpx.MockTransport(router)) as coordinator,
        pytest.raises(SyncError, match="401") as err,
    ):
        coordinator.sync_weights(3, seed=3, replicas=[replica])
    assert isinstance(err.value.__cause__, httpx.HTTPStatusError) and _resumed_routing(router)


def test_the_blocking_client_has_the_async_ones_signatures() -> None:
    public = {name for name in vars(BlockingRolloutCoordinator) if not name.startswith("_")}
    assert public == {name for name in vars(RolloutCoordinator) if not name.startswith("_")} - {"push_stats_forever"}
    for name in [*public, "__init__"]:
        blocking = inspect.signature(getattr(BlockingRolloutCoordinator, name))
        assert blocking.parameters == inspect.signature(getattr(RolloutCoordinator, name)).parameters, name
        assert all(p.kind is not p.VAR_KEYWORD for p in blocking.parameters.values()), name


def test_a_sync_failure_says_why() -> None:
    unimplemented = AioRpcError(grpc.StatusCode.UNIMPLEMENTED, Metadata(), Metadata(), "Method not found!")
    assert "does not serve psrl.control.ReplicaControl" in _failure_reason(unimplemented)
    assert "--engine vllm" in _failure_reason(unimplemented)
    refused = AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, Metadata(), Metadata(), "cannot load /x")
    assert _failure_reason(refused) == "INVALID_ARGUMENT: cannot load /x"
    assert _failure_reason(TimeoutError("late")) == "TimeoutError: late"

"""The admission step over a fake PSManager client: filtering, indicators, commit and the aborted checks."""

from __future__ import annotations

import pytest

from psrl.psmanager.state import ReserveResult
from psrl.router.errors import RequestAborted
from psrl.router.metadata import RoutingMeta
from psrl.router.psmanager_admission import PlacementRefused, PSManagerAdmission
from psrl.router.registry import InstanceId, WorkerRegistry


class FakeClient:
    def __init__(self, reservable: set[int], aborted: bool = False, reserve_ok: bool = True) -> None:
        self.reservable, self.aborted, self.reserve_ok = reservable, aborted, reserve_ok
        self.calls: list[tuple] = []

    async def can_reserve(self, ids, versions, is_validate=False):
        return [[v in self.reservable for v in versions] for _ in ids]

    async def reserve_indicators(self, rid, versions, is_validate=False):
        return [-float(v) for v in versions]

    async def reserve(self, instances, ids, versions, is_validate=False):
        self.calls.append(("reserve", tuple(instances[0]), versions[0]))
        return ReserveResult(self.reserve_ok, [0], [0], "" if self.reserve_ok else "full")

    async def update_request_instance(self, rid, instance, is_validate=False):
        self.calls.append(("move", tuple(instance)))
        return True

    async def check_aborted_requests(self, ids, remove=False):
        return [self.aborted for _ in ids]


def _instances():
    reg = WorkerRegistry()
    for i, v in enumerate((1, 2)):
        reg.create_worker(f"w{i}", f"grpc://h:{i + 1}", models=["m"], labels={}).instances[0].synced_version = v
    return reg.instances()


META = RoutingMeta(request_id=5, prompt_id=5)


async def test_admit_keeps_reservable_versions_only_for_unversioned_requests() -> None:
    insts = _instances()
    hook = PSManagerAdmission(FakeClient({2}))  # type: ignore[arg-type]
    assert await hook.admit(insts, META) == [insts[1]]
    assert await hook.admit(insts, RoutingMeta(request_id=5, prompt_id=5, version_tag=1)) == insts
    assert await hook.indicators(insts, META) == [-1.0, -2.0]


async def test_admit_answers_an_aborted_request_instead_of_queueing_it() -> None:
    hook = PSManagerAdmission(FakeClient(set(), aborted=True))  # type: ignore[arg-type]
    with pytest.raises(RequestAborted):
        await hook.admit(_instances(), META)
    assert await hook.is_aborted(META)


async def test_commit_reserves_or_moves_a_hinted_request() -> None:
    insts = _instances()
    client = FakeClient({1, 2})
    hook = PSManagerAdmission(client)  # type: ignore[arg-type]
    await hook.on_commit(insts[1], META, 2)
    hinted = RoutingMeta(request_id=5, prompt_id=5, hint=InstanceId("w0", 0))
    await hook.on_commit(insts[1], hinted, 2)
    assert client.calls == [("reserve", ("w1", 0), 2), ("move", ("w1", 0))]
    refusing = PSManagerAdmission(FakeClient({1}, reserve_ok=False))  # type: ignore[arg-type]
    with pytest.raises(PlacementRefused, match="full"):
        await refusing.on_commit(insts[0], META, 1)

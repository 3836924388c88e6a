"""Shared by the routing tests: an admission hook that counts its calls and can fail or wait, and a wait on a
condition."""

from __future__ import annotations

import asyncio

from psrl.router.selector import PassThroughAdmission


class CountingAdmission(PassThroughAdmission):
    """Admits instances of version >= `min_version` and counts the calls; `on_commit` waits for `commit_gate`
    (when set), then raises `commit_errors`' next item (None: records it)."""

    def __init__(self, min_version: int = 0) -> None:
        self.min_version = min_version
        self.calls: list[str] = []
        self.commit_errors: list[BaseException | None] = []
        self.commit_gate: asyncio.Event | None = None

    async def admit(self, candidates, meta):
        self.calls.append("admit")
        return [c for c in candidates if c.weight_version >= self.min_version]

    async def indicators(self, candidates, meta):
        self.calls.append("indicators")
        return [float(c.inflight) for c in candidates]

    async def on_commit(self, instance, meta, pinned_version):
        self.calls.append("on_commit")
        if self.commit_gate is not None:
            await self.commit_gate.wait()
        error = self.commit_errors.pop(0) if self.commit_errors else None
        if error is not None:
            raise error

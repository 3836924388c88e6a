"""The thunder_agent strategy's driver: every check interval it reads the instances' KV capacity and usage from
the router (GET /workers for the `max_model_len` label, GET /workers/stats for each rank's kv_cache_usage) and
the sessions, runs a round of `ThunderScheduler` and applies the plan. One driver over two adapters of the
sessions: `LocalSessions` (in the SessionRouter's process, `--session-strategy thunder_agent`) and
`HttpSessions` (a SessionRouter's control API, for `RolloutCoordinator.session_strategy`). A round whose reads
fail is skipped (logged and counted); the loop goes on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from psrl.session.config import ThunderConfig
from psrl.session.thunder import InstanceView, Plan, Resume, SessionView, ThunderScheduler, instance_order

logger = logging.getLogger("psrl.session.thunder")

CAPACITY_LABEL = "max_model_len"  # what PSRL's replicas register as their per-rank KV capacity, in tokens
_HOLD_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

RouterRead = Callable[[str], Awaitable[Any]]  # GET path on the router -> its JSON body (raises on failure)


class ReadError(RuntimeError):
    """A read the round needs failed or answered nonsense: the round is skipped."""


# ---- what the router says about the instances ----------------------------------------------------------------


def instances_from(workers: Any, stats: Any) -> list[InstanceView]:
    """The instances the strategy may place sessions on, from GET /workers and GET /workers/stats: healthy, not
    paused, and with a positive `max_model_len` label (the KV capacity of each rank). Others are left out: the
    sessions on them count nowhere until they are served elsewhere."""
    try:
        capacity: dict[str, int] = {}
        for w in workers["workers"]:
            label = (w.get("labels") or {}).get(CAPACITY_LABEL)
            if not isinstance(label, (str, int, float)):
                continue
            try:
                value = int(float(label))
            except (TypeError, ValueError):
                continue
            if value > 0:
                capacity[str(w["worker_id"])] = value
        out = []
        for inst in stats["workers"]:
            base = str(inst["base_worker_id"])
            if base not in capacity or not inst.get("healthy", True) or inst.get("paused", False):
                continue
            usage = float(inst.get("kv_cache_usage") or 0.0)
            usage = min(1.0, max(0.0, usage)) if math.isfinite(usage) else 0.0
            out.append(InstanceView((base, str(inst["dp_rank"])), capacity[base], usage))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ReadError(f"the router's worker listing is malformed ({type(e).__name__}: {e})") from e
    return sorted(out, key=lambda i: instance_order(i.key))


async def read_instances(read: RouterRead) -> list[InstanceView]:
    return instances_from(await read("/workers"), await read("/workers/stats"))


# ---- the sessions ---------------------------------------------------------------------------------------------


def session_from_summary(entry: Mapping[str, Any]) -> SessionView:
    """A /control/sessions entry (SessionState.summary) as the strategy sees it."""
    base = entry.get("base_worker_id")
    rank = entry.get("target_dp_rank")
    instance = (str(base), "0" if rank is None else str(rank)) if base else None
    return SessionView(
        session_id=str(entry["session_id"]),
        instance=instance,
        generating=entry.get("status") == "generate",
        tokens=int(entry.get("total_tokens") or 0),
        hung=entry.get("hang_state") == "hung",
        marked=bool(entry.get("marked_for_hang")),
        closing=bool(entry.get("closing")),
    )


def resume_item(r: Resume) -> dict[str, Any]:
    """A /control/continue item: with a pin, the instance its next turn is force-pinned to."""
    item: dict[str, Any] = {"session_id": r.session_id}
    if r.pin is not None:
        item["base_worker_id"], item["target_dp_rank"] = r.pin
    return item


class SessionControl(Protocol):
    """Where the driver reads sessions and applies decisions."""

    async def sessions(self) -> list[SessionView]: ...

    async def hang(self, session_ids: Sequence[str]) -> None: ...

    async def resume(self, resumes: Sequence[Resume]) -> None: ...

    async def aclose(self) -> None: ...


class LocalSessions:
    """The SessionRouter's own sessions, in its process. No call awaits: a read, its round and the applied
    decisions happen with no turn starting or ending in between."""

    def __init__(
        self,
        summaries: Callable[[], list[dict[str, Any]]],
        hang: Callable[[list[tuple[str, dict[str, Any]]]], Any],
        resume: Callable[[list[tuple[str, dict[str, Any]]]], Any],
    ) -> None:
        self._summaries, self._hang, self._resume = summaries, hang, resume

    async def sessions(self) -> list[SessionView]:
        return [session_from_summary(s) for s in self._summaries()]

    async def hang(self, session_ids: Sequence[str]) -> None:
        if session_ids:
            self._hang([(sid, {}) for sid in session_ids])

    async def resume(self, resumes: Sequence[Resume]) -> None:
        if resumes:
            self._resume([(r.session_id, resume_item(r)) for r in resumes])

    async def aclose(self) -> None:
        pass


class HttpSessions:
    """A SessionRouter's sessions over its control API (/control/sessions, /control/hang, /control/continue)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            resp = await self._client.request(method, path, json=body)
            resp.raise_for_status()
            return resp.json()
        except (httpx.HTTPError, ValueError) as e:
            raise ReadError(f"SessionRouter {method} {path} failed: {type(e).__name__}: {e}") from e

    async def sessions(self) -> list[SessionView]:
        answer = await self._call("GET", "/control/sessions")
        try:
            return [session_from_summary(s) for s in answer["sessions"]]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ReadError(f"the SessionRouter's session listing is malformed ({type(e).__name__}: {e})") from e

    async def hang(self, session_ids: Sequence[str]) -> None:
        if session_ids:
            await self._call("POST", "/control/hang", list(session_ids))

    async def resume(self, resumes: Sequence[Resume]) -> None:
        if resumes:
            await self._call("POST", "/control/continue", [resume_item(r) for r in resumes])

    async def aclose(self) -> None:
        await self._client.aclose()


# ---- metrics --------------------------------------------------------------------------------------------------


class ThunderMetrics:
    """The strategy's Prometheus metrics (the SessionRouter serves them at GET /metrics)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.hung = Counter(
            "psrl_session_thunder_hung", "sessions the strategy hung, marked to hang, or held at creation", registry=r
        )
        self.continued = Counter(
            "psrl_session_thunder_continued",
            "sessions the strategy continued, by reason (fits, max_hold, admitted: a held new session)",
            ["reason"],
            registry=r,
        )
        for reason in ("fits", "max_hold", "admitted"):
            self.continued.labels(reason)
        self.hold = Histogram(
            "psrl_session_thunder_hold_seconds",
            "how long a session continued by the strategy was held",
            buckets=_HOLD_BUCKETS,
            registry=r,
        )
        self.remaining = Gauge(
            "psrl_session_thunder_remaining_tokens",
            "an instance's remaining KV capacity at the last round (below 0: overfull)",
            ["base_worker_id", "dp_rank"],
            registry=r,
        )
        self.hung_now = Gauge("psrl_session_thunder_sessions_hung", "sessions the strategy holds hung", registry=r)
        self.rounds = Counter("psrl_session_thunder_rounds", "rounds of the strategy run", registry=r)
        self.skipped = Counter(
            "psrl_session_thunder_skipped_rounds", "rounds skipped because a read failed", registry=r
        )

    def record(self, plan: Plan) -> None:
        self.rounds.inc()
        self.hung.inc(len(plan.hang))
        for r in plan.resume:
            self.continued.labels(r.reason).inc()
            self.hold.observe(r.held_s)
        self.remaining.clear()
        for (base, rank), value in plan.remaining.items():
            self.remaining.labels(base, rank).set(value)
        self.hung_now.set(plan.hung_now)


# ---- the driver -----------------------------------------------------------------------------------------------


class ThunderDriver:
    """Runs the strategy: `step()` is one round, `run()` rounds until cancelled, `start()`/`stop()` run it as a
    task. `admit(sid)` judges a session just created (the in-process SessionRouter calls it)."""

    def __init__(
        self,
        config: ThunderConfig,
        router: RouterRead,
        sessions: SessionControl,
        metrics: ThunderMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.scheduler = ThunderScheduler(config)
        self.metrics = metrics if metrics is not None else ThunderMetrics()
        self._router = router
        self._sessions = sessions
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    async def step(self) -> Plan:
        """One round: read, decide, apply. Raises ReadError when a read fails (nothing was decided then)."""
        try:
            instances = await read_instances(self._router)
            sessions = await self._sessions.sessions()
        except ReadError:
            raise
        except Exception as e:
            raise ReadError(f"{type(e).__name__}: {e}") from e
        now = self._clock()
        plan = self.scheduler.plan(instances, sessions, now)
        try:
            await self._sessions.hang(plan.hang)
        except Exception as e:  # the next round sees who did not hang and forgets them
            logger.warning("thunder_agent: hanging %s failed: %s", plan.hang, e)
        try:
            await self._sessions.resume(plan.resume)
        except Exception as e:
            logger.warning("thunder_agent: continuing %s failed: %s", [r.session_id for r in plan.resume], e)
            self.scheduler.undo(plan.resume, now)
            plan.resume = []
        self.metrics.record(plan)
        if plan.hang or plan.resume:
            logger.info(
                "thunder_agent: hung %s, continued %s", plan.hang, [(r.session_id, r.reason) for r in plan.resume]
            )
        return plan

    async def run(self) -> None:
        interval = self.config.check_interval_ms / 1000
        while True:
            try:
                await self.step()
            except ReadError as e:
                self.metrics.skipped.inc()
                logger.warning("thunder_agent: round skipped: %s", e)
            except Exception:  # a bug must not stop the strategy for good
                self.metrics.skipped.inc()
                logger.exception("thunder_agent: round failed")
            await asyncio.sleep(interval)

    def admit(self, session_id: str) -> bool:
        """May a session just created run now? False: the caller hangs it (held until a round admits it)."""
        admitted = self.scheduler.admit_new(session_id, self._clock())
        if not admitted:
            self.metrics.hung.inc()
            self.metrics.hung_now.inc()
        return admitted

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="psrl-thunder-agent")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def aclose(self) -> None:
        await self.stop()
        await self._sessions.aclose()

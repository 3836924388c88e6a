"""The coordinator's endpoints on the registry (docs/compat.md section 6): stats pushes, weight versions, pause/resume.

Pure functions from a parsed body to the response body SMG sends, so the shapes are tested without a server.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from psrl.router.errors import BadRequest
from psrl.router.registry import InstanceState, SchedulerStats, Worker, WorkerRegistry


def _entries(body: Any, wrapped_key: str) -> list[Any]:
    """A bare list, or (older SMG) the list wrapped as {wrapped_key: [...]}, or a single object."""
    if isinstance(body, dict) and wrapped_key in body:
        body = body[wrapped_key]
    elif isinstance(body, dict):
        body = [body]
    if not isinstance(body, list):
        raise BadRequest(f"body must be a list of objects (or {{'{wrapped_key}': [...]}})")
    return body


def _timestamp(value: Any) -> float:
    if value is None:
        raise ValueError("timestamp is required")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"timestamp must be an ISO-8601 string, got {value!r}")
    parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        raise ValueError(f"timestamp {value!r} has no time zone (use a trailing Z)")
    return parsed.timestamp()


def _rank(entry: dict[str, Any], worker: Worker, *, required: bool) -> int:
    rank = entry.get("dp_rank")
    if rank is None:
        if required and worker.dp_size > 1:
            raise ValueError(f"worker {worker.worker_id} has dp_size {worker.dp_size}: dp_rank is required")
        return 0
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < worker.dp_size:
        raise ValueError(f"dp_rank {rank!r} is out of range for dp_size {worker.dp_size}")
    return rank


def _worker(registry: WorkerRegistry, entry: Any, *keys: str) -> tuple[Worker, str]:
    if not isinstance(entry, dict):
        raise ValueError("each entry must be an object")
    for key in keys:
        if entry.get(key) is not None:
            worker = registry.get(str(entry[key]))
            if worker is None:
                raise ValueError(f"unknown worker {entry[key]!r}")
            return worker, key
    raise ValueError(f"entry needs {' or '.join(keys)}")


def _int_map(value: Any, name: str) -> dict[str, int]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object")
    return {str(k): int(v) for k, v in value.items()}


# ---- POST /workers/update_stats ------------------------------------------------------------------------


def update_stats(registry: WorkerRegistry, body: Any) -> dict[str, Any]:
    results = []
    counts = {"updated": 0, "rejected": 0, "stale_ignored": 0}
    for entry in _entries(body, "stats"):
        result: dict[str, Any] = {"worker_id": entry.get("worker_id") if isinstance(entry, dict) else None}
        try:
            worker, _ = _worker(registry, entry, "worker_id", "base_worker_id")
            rank = _rank(entry, worker, required=True)
            result["dp_rank"] = rank
            ts = _timestamp(entry.get("timestamp"))
            raw = entry.get("scheduler_stats") or {}
            if not isinstance(raw, dict):
                raise ValueError("scheduler_stats must be an object")
            stats = SchedulerStats(
                num_running_reqs=int(raw.get("num_running_reqs", 0)),
                num_waiting_reqs=int(raw.get("num_waiting_reqs", 0)),
                kv_cache_usage=_usage(raw.get("kv_cache_usage", 0.0)),
                req_id_to_prompt_token_num=_int_map(
                    raw.get("req_id_to_prompt_token_num"), "req_id_to_prompt_token_num"
                ),
                req_id_to_response_token_num=_int_map(
                    raw.get("req_id_to_response_token_num"), "req_id_to_response_token_num"
                ),
                timestamp=ts,
            )
        except (ValueError, TypeError, OverflowError) as e:  # OverflowError: an infinite count
            result.update(status="rejected", reason=str(e))
            counts["rejected"] += 1
            results.append(result)
            continue
        instance = worker.instances[rank]
        if ts < instance.stats.timestamp:
            result.update(status="stale_ignored", reason="timestamp is older than the last report")
            counts["stale_ignored"] += 1
        else:
            instance.stats = stats
            result["status"] = "updated"
            counts["updated"] += 1
        results.append(result)
    return {"total": len(results), **counts, "results": results}


def _usage(raw: Any) -> float:
    usage = float(raw)
    if not math.isfinite(usage):
        raise ValueError(f"kv_cache_usage must be a finite number, got {raw!r}")
    return usage


# ---- POST /workers/update_weight_version ---------------------------------------------------------------


def update_weight_version(registry: WorkerRegistry, body: Any) -> dict[str, Any]:
    entries = _entries(body, "updates")
    results: list[dict[str, Any]] = []
    accepted: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}  # worker -> [(rank, version, result)]
    for entry in entries:
        result: dict[str, Any] = {"worker_id": entry.get("worker_id") if isinstance(entry, dict) else None}
        results.append(result)
        try:
            worker, _ = _worker(registry, entry, "worker_id", "base_worker_id")
            result["url"] = worker.url
            rank = _rank(entry, worker, required=True)
            if "dp_rank" in entry:
                result["dp_rank"] = rank
            version = entry.get("weight_version")
            if isinstance(version, bool) or not isinstance(version, int):
                raise ValueError(f"weight_version must be an integer, got {version!r}")
            result["weight_version"] = version
            accepted.setdefault(worker.worker_id, []).append((rank, version, result))
        except (ValueError, TypeError) as e:
            result.update(status="rejected", reason=str(e))
    for worker_id, updates in accepted.items():
        target = registry.get(worker_id)
        assert target is not None
        ranks = sorted({rank for rank, _, _ in updates})
        if ranks != list(range(target.dp_size)) or len(updates) != target.dp_size:
            # A replica's ranks share one set of weights: updating only some of them would be a lie.
            reason = f"partial replica update: ranks {ranks} of dp_size {target.dp_size} (send every rank once)"
            for _, _, result in updates:
                result.update(status="rejected", reason=reason)
            continue
        for rank, version, result in updates:
            target.instances[rank].synced_version = version
            result["status"] = "updated"
    rejected = sum(r.get("status") == "rejected" for r in results)
    return {"total": len(results), "updated": len(results) - rejected, "rejected": rejected, "results": results}


# ---- POST /workers/pause and /workers/resume -----------------------------------------------------------


def set_paused(registry: WorkerRegistry, body: Any, paused: bool) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    seen: set[tuple[str, int | str | None]] = set()
    for entry in _entries(body, "workers"):
        try:
            worker, key = _worker(registry, entry, "base_worker_id", "worker_id")
        except ValueError as e:
            ident = entry.get("base_worker_id", entry.get("worker_id")) if isinstance(entry, dict) else None
            results.append({"status": "rejected", "paused": None, "reason": str(e), "worker_id": ident})
            continue
        raw = entry.get("dp_rank")
        ranks: list[Any] = list(raw) if isinstance(raw, list) else [raw]
        for rank in ranks:
            key_of = (worker.worker_id, rank if rank is None or isinstance(rank, int) else repr(rank))
            if key_of in seen:
                continue
            seen.add(key_of)
            result: dict[str, Any] = {key: worker.worker_id}
            if rank is not None:
                result["dp_rank"] = rank
            targets: list[InstanceState]
            if rank is None:
                targets = list(worker.instances)
            elif isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < worker.dp_size:
                targets = [worker.instances[rank]]
            else:
                result.update(
                    status="rejected",
                    paused=None,
                    reason=f"dp_rank {rank!r} is out of range for dp_size {worker.dp_size}",
                )
                results.append(result)
                continue
            for inst in targets:
                inst.paused = paused
            result.update(status="updated", paused=paused, reason=None)
            results.append(result)
    rejected = sum(r["status"] == "rejected" for r in results)
    return {
        "action": "paused" if paused else "resumed",
        "updated": len(results) - rejected,
        "rejected": rejected,
        "results": results,
    }


def worker_stats(registry: WorkerRegistry) -> dict[str, Any]:
    instances = [i.to_json() for i in registry.instances()]
    return {
        "workers": instances,
        "total_running_requests": sum(i["running_requests"] for i in instances),
        "total_inflight_requests": sum(i["inflight_requests"] for i in instances),
    }

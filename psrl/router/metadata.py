"""PSRL routing metadata from request headers (docs/compat.md section 2). Pure; a bad value is a BadRequest."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from psrl.router.errors import BadRequest
from psrl.router.registry import InstanceId

_TRUE = frozenset({"1", "true", "t", "yes", "y"})
_FALSE = frozenset({"0", "false", "f", "no", "n", ""})

ROUTING_KEY_HEADER = "x-smg-routing-key"
_HEADERS = frozenset(
    (
        "x-request-id",
        "x-prompt-id",
        "x-version-tag",
        "x-base-worker-id",
        "x-target-dp-rank",
        "x-is-validate",
        "x-is-sticky",
        "x-force-pin-once",
        ROUTING_KEY_HEADER,
    )
)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class RoutingMeta(NamedTuple):
    """What the PSRL selector reads. `request_id`/`prompt_id` are None when the headers are absent: such a
    request is routed by the policy alone. Built once a PSRL request: a named tuple is as immutable as a frozen
    dataclass and a third of its cost to build."""

    request_id: int | None = None
    prompt_id: int | None = None
    version_tag: int = -1
    is_validate: bool = False
    is_sticky: bool = False
    force_pin_once: bool = False
    hint: InstanceId | None = None  # x-base-worker-id + x-target-dp-rank
    routing_key: str | None = None

    @property
    def has_psrl(self) -> bool:
        return self.request_id is not None and self.prompt_id is not None

    @property
    def pinned(self) -> bool:
        """Hard-pin to the hint (selection step 2) rather than using it only as a KV-transfer source."""
        return self.hint is not None and (self.is_sticky or self.force_pin_once)


NO_ROUTING_META = RoutingMeta()  # a request without PSRL headers (immutable: one instance serves all)


def _int(headers: Mapping[str, str], name: str) -> int | None:
    raw = headers.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise BadRequest(f"header {name} must be an integer, got {raw[:64]!r}", param=name) from None
    if not INT64_MIN <= value <= INT64_MAX:  # PSRL's ids and versions are i64 (the PSManager's too)
        raise BadRequest(f"header {name} must fit in an int64, got {raw[:64]!r}", param=name)
    return value


def _bool(headers: Mapping[str, str], name: str) -> bool:
    raw = headers.get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise BadRequest(f"header {name} must be a boolean (1/true/yes or 0/false/no), got {raw!r}", param=name)


def parse_routing_meta(headers: Mapping[str, str]) -> RoutingMeta:
    """Read the PSRL headers from a case-insensitive mapping (the router's asgi.Request headers: lower-case names)."""
    if _HEADERS.isdisjoint(headers):
        return NO_ROUTING_META  # most requests that are not PSRL's: nothing to read
    request_id = _int(headers, "x-request-id")
    prompt_id = _int(headers, "x-prompt-id")
    version = _int(headers, "x-version-tag")
    if version is not None and version < -1:
        raise BadRequest(f"header x-version-tag must be -1 or a version >= 0, got {version}", param="x-version-tag")
    base = headers.get("x-base-worker-id")
    rank = _int(headers, "x-target-dp-rank")
    if rank is not None and rank < 0:
        raise BadRequest(f"header x-target-dp-rank must be >= 0, got {rank}", param="x-target-dp-rank")
    hint = InstanceId(base.strip(), rank or 0) if base and base.strip() else None
    return RoutingMeta(
        request_id=request_id,
        prompt_id=prompt_id,
        version_tag=-1 if version is None else version,
        is_validate=_bool(headers, "x-is-validate"),
        is_sticky=_bool(headers, "x-is-sticky"),
        force_pin_once=_bool(headers, "x-force-pin-once"),
        hint=hint,
        routing_key=headers.get(ROUTING_KEY_HEADER) or None,
    )

"""`psrl.experts.RoutedExperts` (proto/psrl/_proto/routed_experts.proto), shared by both replica kinds: the MoE
routing a Generate asked for (metadata `x-psrl-routed-experts-start`), kept from its complete frame until the
router takes it, a TTL passes, or newer entries need the room.

Nothing is kept for a Generate that did not ask, so the service costs nothing when unused.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from psrl._proto import routed_experts_pb2 as pb
from psrl._proto import routed_experts_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# Generate metadata asking for the routing from this position on (the router's side: psrl.router.pipeline.execute).
ROUTED_EXPERTS_METADATA_KEY = "x-psrl-routed-experts-start"
# The router takes an entry right after the complete frame; a TTL only bounds what nobody came for.
DEFAULT_TTL_S = 120.0
DEFAULT_MAX_BYTES = 256 << 20


class BadRoutedExpertsAsk(ValueError):
    """The metadata's value is not a position."""


def asked_start(metadata: Sequence[tuple[str, str | bytes]] | None) -> int | None:
    """The first position a Generate's metadata asks routing for; None when it does not ask."""
    for key, value in metadata or ():
        if key == ROUTED_EXPERTS_METADATA_KEY:
            text = value.decode() if isinstance(value, bytes) else value
            try:
                start = int(text)
            except ValueError:
                raise BadRoutedExpertsAsk(f"{ROUTED_EXPERTS_METADATA_KEY} must be an integer, got {text!r}") from None
            if start < 0:
                raise BadRoutedExpertsAsk(f"{ROUTED_EXPERTS_METADATA_KEY} must be >= 0, got {start}")
            return start
    return None


@dataclass(frozen=True)
class _Entry:
    rows: np.ndarray  # [n, num_layers, top_k]
    prompt_start: int
    expires_at: float  # time.monotonic()


class RoutedExpertsStore:
    """Routing kept per (request id, choice), oldest first. Used from the replica's event loop only."""

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, request_id: str, index: int, rows: np.ndarray, prompt_start: int) -> None:
        """Keep a choice's routing `[n, num_layers, top_k]` (a second put for the same choice replaces it)."""
        if rows.ndim != 3:
            raise ValueError(f"routed experts must be [n, num_layers, top_k], got shape {rows.shape}")
        self._expire()
        self._drop((request_id, index))
        if rows.nbytes > self.max_bytes:
            logger.warning(
                "routed experts of %s (%d bytes) exceed the store's %d bytes: not kept",
                request_id,
                rows.nbytes,
                self.max_bytes,
            )
            return
        while self._entries and self._bytes + rows.nbytes > self.max_bytes:
            oldest = next(iter(self._entries))
            logger.warning("routed experts of %s choice %d dropped untaken: the store is full", *oldest)
            self._drop(oldest)
        self._entries[(request_id, index)] = _Entry(rows, prompt_start, self._clock() + self.ttl_s)
        self._bytes += rows.nbytes

    def take(self, request_id: str, index: int) -> tuple[np.ndarray, int] | None:
        """(rows, prompt_start) of a choice, forgotten here; None when nothing is kept for it."""
        self._expire()
        entry = self._entries.pop((request_id, index), None)
        if entry is None:
            return None
        self._bytes -= entry.rows.nbytes
        return entry.rows, entry.prompt_start

    def _drop(self, key: tuple[str, int]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.rows.nbytes

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires_at > now:
                return  # entries are in insertion order and share one TTL: the rest expire later
            self._drop(key)


class RoutedExpertsServicer(pb_grpc.RoutedExpertsServicer):
    """Serves a store. `unsupported`: why this replica cannot record routing (None when it can)."""

    def __init__(self, store: RoutedExpertsStore, unsupported: str | None = None) -> None:
        self.store = store
        self.unsupported = unsupported

    async def TakeRoutedExperts(
        self, request: pb.TakeRoutedExpertsRequest, context: grpc.aio.ServicerContext
    ) -> pb.TakeRoutedExpertsResponse:
        if self.unsupported is not None:
            return pb.TakeRoutedExpertsResponse(status=pb.ROUTED_EXPERTS_UNSUPPORTED, reason=self.unsupported)
        kept = self.store.take(request.request_id, request.index)
        if kept is None:
            return pb.TakeRoutedExpertsResponse(
                status=pb.ROUTED_EXPERTS_NOT_RECORDED,
                reason=f"no routed experts kept for {request.request_id!r} choice {request.index} "
                "(not asked for, already taken, expired, or the call ended before its complete frame)",
            )
        rows, prompt_start = kept
        rows = np.ascontiguousarray(rows, dtype=rows.dtype.newbyteorder("<"))
        return pb.TakeRoutedExpertsResponse(
            status=pb.ROUTED_EXPERTS_OK,
            data=rows.tobytes(),
            num_rows=rows.shape[0],
            num_layers=rows.shape[1],
            top_k=rows.shape[2],
            dtype=rows.dtype.name,
            prompt_start=prompt_start,
        )

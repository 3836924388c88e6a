"""POSIX shared memory between processes on one host: :class:`ShmChannel` and its pool and mappings.

The source gathers its blocks straight into the segment and the destination scatters straight out of it: one
copy on each side, none in between. Segment names are unguessable and the segments are private to the user
(mode 0600). A typical migration::

    # source replica                                   # destination replica
    with shm_send(caches, ids, num_tokens=n) as ch:
        send_to_peer(ch.transfer.to_dict())   ------>    transfer = ShmTransfer.from_dict(msg)
                                                         shm_receive(transfer, caches, new_ids)  # unlinks
        wait_for_ack()                        <------    ack()
    # leaving the block unlinks and unmaps the segment on the source side too
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np

from psrl import _kvx
from psrl.kv.blocks import (
    DTYPE_ITEMSIZE,
    ArrayLike,
    BlockIds,
    KVCacheLayout,
    KVLayoutMismatchError,
    _as_block_ids,
    _gather,
    describe_kv_cache,
    gather_blocks,
    scatter_blocks,
)
from psrl.kv.channels.base import KVChannelError

__all__ = [
    "ShmChannel",
    "ShmMappings",
    "ShmPool",
    "ShmSegment",
    "ShmSegmentNotFoundError",
    "ShmSizeMismatchError",
    "ShmTransfer",
    "new_segment_name",
    "shm_receive",
    "shm_send",
]

ShmSegment = _kvx.ShmSegment

_SEGMENT_PREFIX = "psrl-kv"
_BITS_DTYPE = {2: np.int16, 4: np.int32}  # numpy view of a dtype numpy may lack (bf16)


class ShmSegmentNotFoundError(KVChannelError, FileNotFoundError):
    """The shared-memory segment named by a transfer does not exist (never created, or already unlinked)."""


class ShmSizeMismatchError(KVChannelError, ValueError):
    """The segment's size differs from what its transfer descriptor says: a stale or foreign segment."""


def new_segment_name(prefix: str = _SEGMENT_PREFIX) -> str:
    """An unguessable shared-memory name: ``/<prefix>-<pid>-<128 random bits>``."""
    return f"/{prefix}-{os.getpid()}-{secrets.token_hex(16)}"


@dataclass(frozen=True)
class ShmTransfer:
    """What the destination needs to find and read a segment: send it over any control channel."""

    name: str
    shape: tuple[int, int, int, int, int, int]  # [num_layers, 2, num_ids, block_size, num_kv_heads, head_size]
    dtype: str  # "float16", "bfloat16" or "float32"
    num_tokens: int | None = None  # tokens the blocks hold (None: all full); see psrl.kv.gather_blocks
    # A pooled segment (ShmPool) outlives the transfer: it may be larger than the buffer (which is at its
    # start), the destination must not unlink it, and may keep it mapped for the next transfer (ShmMappings).
    pooled: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"unsupported dtype {self.dtype!r}: expected one of {sorted(DTYPE_ITEMSIZE)}")
        if len(self.shape) != 6 or any(int(n) < 0 for n in self.shape) or int(self.shape[1]) != 2:
            raise ValueError(f"shape {list(self.shape)} is not [num_layers, 2, num_ids, block_size, heads, head_size]")
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def num_ids(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "num_tokens": self.num_tokens}
        return out | ({"pooled": True} if self.pooled else {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShmTransfer:
        num_tokens = data.get("num_tokens")
        return cls(
            name=str(data["name"]),
            shape=tuple(int(n) for n in data["shape"]),  # type: ignore[arg-type]
            dtype=str(data["dtype"]),
            num_tokens=None if num_tokens is None else int(num_tokens),
            pooled=bool(data.get("pooled", False)),
        )


def _host_view(buffer: ShmSegment, shape: tuple[int, ...], dtype: str, like: ArrayLike | None) -> ArrayLike:
    """Zero-copy view of a buffer-protocol object as a numpy array, or as a CPU torch tensor when the caches
    (``like``) are torch tensors or the dtype is one numpy lacks (bf16)."""
    torch_like = like is not None and not isinstance(like, np.ndarray)
    count = math.prod(shape)  # the buffer may be longer (a pooled segment): the view is its start
    view = memoryview(buffer)  # the segment's buffer export, held by the arrays made from it
    if not torch_like and dtype != "bfloat16":
        return np.frombuffer(view, dtype=np.dtype(dtype), count=count).reshape(shape)
    torch = sys.modules.get("torch")
    if torch is None:
        raise KVLayoutMismatchError(f"a {dtype} buffer needs torch (numpy has no such dtype); import torch first")
    bits = np.frombuffer(view, dtype=_BITS_DTYPE[DTYPE_ITEMSIZE[dtype]], count=count)
    # torch.from_numpy keeps the numpy array, which keeps the buffer export, alive as long as the tensor.
    return torch.from_numpy(bits).view(getattr(torch, dtype)).reshape(shape)


def _open_segment(transfer: ShmTransfer) -> ShmSegment:
    """Map the segment a source made for `transfer` (checked against it; never unlinked here)."""
    try:
        segment = ShmSegment.open(transfer.name)
    except FileNotFoundError as exc:
        raise ShmSegmentNotFoundError(
            f"shared memory segment {transfer.name!r} does not exist: the source never created it or removed it, "
            "or a destination unlinked it on opening it before"
        ) from exc
    if segment.size < transfer.nbytes or (segment.size != transfer.nbytes and not transfer.pooled):
        segment.close()  # not unlinked: a wrong descriptor must not destroy the segment
        raise ShmSizeMismatchError(
            f"shared memory segment {transfer.name!r} has {segment.size} bytes, the transfer describes "
            f"{transfer.nbytes} ({list(transfer.shape)} {transfer.dtype})"
        )
    return segment


def _unmap(segment: ShmSegment) -> None:
    with contextlib.suppress(BufferError):  # a live view: unmapped when the last one goes
        segment.close()


def _destroy(segment: ShmSegment) -> None:
    with contextlib.suppress(FileNotFoundError):
        segment.unlink()
    _unmap(segment)


class ShmPool:
    """Shared-memory segments the source keeps between transfers.

    Making a segment (allocating and zeroing its pages, mapping them) costs several times the gather into it,
    so a segment whose destination has acknowledged the transfer (:meth:`ShmChannel.recycle`) comes back here
    for the next transfer of its size class (powers of two from ``min_segment_bytes``; a transfer whose class
    exceeds ``max_idle_bytes`` gets a fresh segment of its own size instead). At most ``max_idle_bytes`` stay
    idle, the least recently used given up first. A segment is never reused when its transfer was not
    acknowledged (its reader may still be copying), when something still views it, or when its name is gone
    (removed from outside: a reader could not open it). Thread-safe.
    """

    def __init__(self, max_idle_bytes: int, *, min_segment_bytes: int = 1 << 20) -> None:
        if max_idle_bytes < 0 or min_segment_bytes <= 0:
            raise ValueError("max_idle_bytes must be >= 0 and min_segment_bytes > 0")
        self.max_idle_bytes = max_idle_bytes
        self._min = min_segment_bytes
        self._idle: list[ShmSegment] = []  # mapped segments nobody uses, least recently used first
        self._lock = threading.RLock()  # reentrant: a channel's __del__ may run inside a locked section
        self._closed = False
        self.created = 0  # segments made
        self.reused = 0  # transfers served by an idle segment

    def size_class(self, nbytes: int) -> int:
        return max(self._min, 1 << max(nbytes - 1, 0).bit_length())

    def fits(self, nbytes: int) -> bool:
        """Whether a transfer of `nbytes` goes through the pool (its size class may stay idle here)."""
        return self.size_class(nbytes) <= self.max_idle_bytes

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(seg.size for seg in self._idle)

    def acquire(self, nbytes: int) -> ShmSegment:
        """A mapped segment of `nbytes`' size class for one transfer: the most recently used idle one (likely
        still mapped by its last reader), or a new one."""
        size = self.size_class(nbytes)
        stale = []
        try:
            with self._lock:
                for i in range(len(self._idle) - 1, -1, -1):
                    seg = self._idle[i]
                    if seg.size != size:
                        continue
                    del self._idle[i]
                    if seg.linked:
                        self.reused += 1
                        return seg
                    stale.append(seg)
                self.created += 1
            return ShmSegment.create(new_segment_name(), size)
        finally:
            for seg in stale:
                _destroy(seg)

    def release(self, segment: ShmSegment) -> None:
        """A segment its reader is done with: idle for the next transfer, or destroyed when it may not be reused
        (see the class) or does not fit."""
        evicted = [segment]
        with self._lock:
            reusable = not self._closed and not segment.closed and segment.exports == 0 and segment.linked
            if reusable and segment.size <= self.max_idle_bytes:
                self._idle.append(segment)
                evicted = []
                idle = sum(seg.size for seg in self._idle)
                while idle > self.max_idle_bytes:
                    evicted.append(self._idle.pop(0))
                    idle -= evicted[-1].size
        for seg in evicted:
            _destroy(seg)

    def retire(self, segment: ShmSegment) -> None:
        """A segment that must not be reused (unacknowledged, or failed): unlinked and unmapped."""
        _destroy(segment)

    def close(self) -> None:
        """Destroy the idle segments; segments released later are destroyed too."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for seg in idle:
            _destroy(seg)


class ShmMappings:
    """The destination's mappings of pooled segments, kept open by name so a segment the source reuses is read
    without mapping it again (mapping populates its page tables: a cost of the order of the copy itself).

    At most ``max_bytes`` stay mapped while unused: mappings of segments whose name is gone (the source gave
    them up) are dropped first, then the least recently used. A mapping in use is never unmapped. Until it is
    dropped, a mapping of a segment its source has given up still holds that segment's memory. Thread-safe.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._maps: OrderedDict[str, list[Any]] = OrderedDict()  # name -> [segment, users]
        self._lock = threading.RLock()  # reentrant: a channel's __del__ may run inside a locked section
        self.opened = 0  # segments mapped

    def acquire(self, transfer: ShmTransfer) -> ShmSegment:
        """The segment of a pooled transfer, mapped (until :meth:`done`)."""
        with self._lock:
            entry = self._maps.get(transfer.name)
            if entry is not None:
                if entry[0].size < transfer.nbytes:  # a name has one size: a wrong descriptor
                    raise ShmSizeMismatchError(
                        f"shared memory segment {transfer.name!r} has {entry[0].size} bytes, the transfer "
                        f"describes {transfer.nbytes}"
                    )
                self._maps.move_to_end(transfer.name)
                entry[1] += 1
                return entry[0]
        segment = _open_segment(transfer)
        with self._lock:
            self.opened += 1
            if transfer.name in self._maps:  # opened twice at once (cannot happen with one transfer per segment)
                return segment  # not tracked: the caller's done() unmaps it
            self._maps[transfer.name] = [segment, 1]
        return segment

    def done(self, segment: ShmSegment) -> None:
        evicted = []
        with self._lock:
            entry = self._maps.get(segment.name)
            if entry is not None and entry[0] is segment:
                entry[1] -= 1
            else:
                evicted.append(segment)
            unused = [name for name, (_, users) in self._maps.items() if users == 0]
            for name in [n for n in unused if not self._maps[n][0].linked]:
                evicted.append(self._maps.pop(name)[0])
            total = sum(seg.size for seg, _ in self._maps.values())
            for name in unused:
                if total <= self.max_bytes:
                    break
                if name in self._maps:
                    seg = self._maps.pop(name)[0]
                    total -= seg.size
                    evicted.append(seg)
        for seg in evicted:
            _unmap(seg)

    @property
    def mapped_bytes(self) -> int:
        with self._lock:
            return sum(seg.size for seg, _ in self._maps.values())

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, OrderedDict()
        for seg, _ in maps.values():
            _unmap(seg)


class ShmChannel:
    """One KV transfer through one POSIX shared-memory segment.

    The source calls :meth:`create`, gathers into it (:meth:`gather`), sends :attr:`transfer` to the
    destination and closes the channel once the destination has opened it (closing the creating side unlinks
    the name). The destination calls :meth:`open` (which unlinks the name at once by default: the mapping
    stays valid, and nothing is left behind if either process dies) and :meth:`scatter`. Both are context
    managers; every exit path unlinks what this side is responsible for and unmaps.

    A pooled segment (``create(pool=...)``) outlives its channel: the source calls :meth:`recycle` once the
    destination has read it all (any other exit retires the segment); the destination never unlinks it, and
    with ``open(mappings=...)`` leaves it mapped for the next transfer.
    """

    def __init__(
        self,
        segment: ShmSegment,
        transfer: ShmTransfer,
        *,
        release: Callable[[ShmSegment], None] | None = None,
        pool: ShmPool | None = None,
    ) -> None:
        self._segment = segment
        self._transfer = transfer
        self._release = release  # where a pooled or cached mapping goes at the end (instead of unlink + unmap)
        self._pool = pool  # the creator's pool, for recycle()
        self._views: dict[str, ArrayLike] = {}
        self._closed = False

    # construction

    @classmethod
    def create(
        cls,
        layout: KVCacheLayout,
        num_ids: int,
        *,
        num_tokens: int | None = None,
        name: str | None = None,
        pool: ShmPool | None = None,
    ) -> ShmChannel:
        """A new zero-filled segment sized for ``num_ids`` blocks of caches with this layout, or one from
        ``pool`` (holding whatever its last transfer left; a transfer too large for the pool gets its own)."""
        if layout.cuda_device is not None:
            raise KVLayoutMismatchError("shared memory carries host caches; the caches are on a CUDA device")
        if pool is not None and name is not None:
            raise ValueError("a pooled segment is named by its pool: pass name or pool, not both")
        shape, nbytes = layout.buffer_shape(num_ids), layout.transfer_nbytes(num_ids)
        if pool is not None and pool.fits(nbytes):
            segment = pool.acquire(nbytes)
            transfer = ShmTransfer(segment.name, shape, layout.dtype, num_tokens, pooled=True)
            return cls(segment, transfer, release=pool.retire, pool=pool)
        transfer = ShmTransfer(
            name=ShmSegment.normalize_name(name or new_segment_name()),
            shape=shape,
            dtype=layout.dtype,
            num_tokens=num_tokens,
        )
        segment = ShmSegment.create(transfer.name, transfer.nbytes)
        return cls(segment, transfer)

    @classmethod
    def open(cls, transfer: ShmTransfer, *, unlink: bool = True, mappings: ShmMappings | None = None) -> ShmChannel:
        """Map the segment a source created for ``transfer``; ``unlink``: remove its name right away. A pooled
        segment is never unlinked here (its source reuses it) and is taken from ``mappings`` when given."""
        if transfer.pooled and mappings is not None:
            return cls(mappings.acquire(transfer), transfer, release=mappings.done)
        segment = _open_segment(transfer)
        if unlink and not transfer.pooled:
            try:
                segment.unlink()
            except BaseException:
                segment.close()
                raise
        return cls(segment, transfer)

    # properties

    @property
    def transfer(self) -> ShmTransfer:
        return self._transfer

    @property
    def name(self) -> str:
        return self._transfer.name

    @property
    def segment(self) -> ShmSegment:
        return self._segment

    @property
    def closed(self) -> bool:
        return self._closed or bool(self._segment.closed)

    def buffer(self, like: ArrayLike | None = None) -> ArrayLike:
        """The segment as the transfer buffer, without copying: a numpy array, or a CPU torch tensor when
        ``like`` is a torch tensor (or the dtype is bf16). A view keeps the mapping alive."""
        if self.closed:
            raise ValueError(f"shared memory channel {self.name!r} is closed")
        kind = "numpy" if like is None or isinstance(like, np.ndarray) else "torch"
        if kind not in self._views:
            self._views[kind] = _host_view(self._segment, self._transfer.shape, self._transfer.dtype, like)
        return self._views[kind]

    # copies

    def gather(self, layer_caches: Sequence[ArrayLike], block_ids: BlockIds, *, num_threads: int | None = None) -> None:
        """Gather blocks of host caches straight into the segment (num_tokens from the transfer)."""
        out = self.buffer(layer_caches[0])
        gather_blocks(layer_caches, block_ids, out=out, num_threads=num_threads, num_tokens=self._transfer.num_tokens)

    def scatter(
        self, layer_caches: Sequence[ArrayLike], block_ids: BlockIds, *, num_threads: int | None = None
    ) -> None:
        """Scatter the segment straight into blocks ``block_ids`` of host caches."""
        buffer = self.buffer(layer_caches[0])
        scatter_blocks(buffer, layer_caches, block_ids, num_threads=num_threads, num_tokens=self._transfer.num_tokens)

    # teardown

    def recycle(self) -> None:
        """The destination is done with this pooled segment: close the channel and give the segment back to its
        pool for the next transfer (any other way of closing retires it)."""
        if self._pool is None:
            raise ValueError(f"shared memory channel {self.name!r} is not from a pool")
        if not self._closed:
            self._release = self._pool.release
            self.close()

    def unlink(self) -> bool:
        """Remove the segment's name (mappings stay valid); False if it was already gone."""
        return bool(self._segment.unlink())

    def close(self) -> None:
        """Close the channel and unmap the segment. Views of it handed out (:meth:`buffer`) stay valid if
        still referenced: the mapping then goes when the last of them and this object are gone."""
        was_closed, self._closed = self._closed, True
        self._views.clear()
        if self._release is not None:
            if not was_closed:  # the pool or the mappings take the segment over, once
                self._release(self._segment)
            return
        with contextlib.suppress(BufferError):  # a live view (maybe in a traceback): unmapped later, safely
            self._segment.close()

    def __enter__(self) -> ShmChannel:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._segment.created and self._release is None:
                self.unlink()  # the creator owns the name; harmless if the destination unlinked it already
        finally:
            self.close()

    def __del__(self) -> None:
        # Last resort for a creator that never unlinked, or a channel never closed: do not leave the name
        # behind in /dev/shm (a pooled segment is retired, a cached mapping given back).
        segment = getattr(self, "_segment", None)
        if segment is None:
            return
        with contextlib.suppress(Exception):
            if self._release is not None:
                self.close()  # runs the release once, whenever the channel is closed
            elif segment.created and not segment.unlinked:
                segment.unlink()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<ShmChannel {self.name!r} {list(self._transfer.shape)} {self._transfer.dtype} {state}>"


def shm_send(
    layer_caches: Sequence[ArrayLike],
    block_ids: BlockIds,
    *,
    num_tokens: int | None = None,
    num_threads: int | None = None,
    name: str | None = None,
    pool: ShmPool | None = None,
) -> ShmChannel:
    """Create a segment (or take one from ``pool``) and gather ``block_ids`` of host caches into it; returns
    the open channel.

    Send ``channel.transfer`` to the destination and close the channel (``with`` block) once it has opened
    the segment: closing unlinks the name. A pooled channel: ``recycle()`` once the destination has read it
    all (closing it any other way retires the segment). On any error the segment is unlinked before this
    raises.
    """
    layout = describe_kv_cache(layer_caches)
    ids = _as_block_ids(block_ids)
    channel = ShmChannel.create(layout, len(ids), num_tokens=num_tokens, name=name, pool=pool)
    try:  # the caches were just described: gather without describing them again
        _gather(layout, layer_caches, ids, channel.buffer(layer_caches[0]), num_threads, None, num_tokens)
    except BaseException:
        channel.__exit__(None, None, None)
        raise
    return channel


def shm_receive(
    transfer: ShmTransfer,
    layer_caches: Sequence[ArrayLike],
    block_ids: BlockIds,
    *,
    num_threads: int | None = None,
    mappings: ShmMappings | None = None,
) -> None:
    """Open the segment of ``transfer`` (unlinking its name at once unless it is pooled), scatter it into
    ``block_ids`` and unmap it (or give a pooled one back to ``mappings``, kept mapped for the next)."""
    with ShmChannel.open(transfer, mappings=mappings) as channel:
        channel.scatter(layer_caches, block_ids, num_threads=num_threads)

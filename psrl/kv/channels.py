"""Channels that move gathered KV blocks between replicas.

Three transports, one buffer layout (``[num_layers, 2, num_ids, block_size, num_kv_heads, head_size]``, see
``psrl.kv.blocks``), so the two sides may use different cache strides (NHD/HND) or block numbering:

* :class:`ShmChannel`: POSIX shared memory between processes on one host. The source gathers its blocks
  straight into the segment and the destination scatters straight out of it: one copy on each side, none
  in between. Segment names are unguessable and the segments are private to the user (mode 0600).
* :class:`CudaIpcExport` / :class:`CudaIpcBuffer`: CUDA IPC between processes on one node. One side
  exports a device buffer (and an interprocess event that marks its writes done), the other opens it and
  scatters out of (or gathers into) the peer's memory with the one-launch kernels, or copies it with
  ``cudaMemcpyPeerAsync``. Only streams and events order the work: no device-wide synchronisation.
* :class:`NcclChannel`: NCCL send/recv between nodes. NCCL is loaded at run time (``nvidia-nccl-cu*`` wheel
  or the loader path); nothing needs it to build or import.

A typical shared-memory migration::

    # source replica                                   # destination replica
    with shm_send(caches, ids, num_tokens=n) as ch:
        send_to_peer(ch.transfer.to_dict())   ------>    transfer = ShmTransfer.from_dict(msg)
                                                         shm_receive(transfer, caches, new_ids)  # unlinks
        wait_for_ack()                        <------    ack()
    # leaving the block unlinks and unmaps the segment on the source side too
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import secrets
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

import psrl._kvx as _kvx  # native module; mypy treats it as untyped
from psrl.kv.blocks import (
    DTYPE_ITEMSIZE,
    HAS_CUDA,
    ArrayLike,
    BlockIds,
    KVCacheLayout,
    KVLayoutMismatchError,
    _gather,
    describe_kv_cache,
    gather_blocks,
    scatter_blocks,
)

__all__ = [
    "CudaEvent",
    "CudaIpcBuffer",
    "CudaIpcDescriptor",
    "CudaIpcExport",
    "CudaUnavailableError",
    "DeviceArray",
    "KVChannelError",
    "KVLayoutMismatchError",
    "NcclChannel",
    "NcclUnavailableError",
    "ShmChannel",
    "ShmMappings",
    "ShmPool",
    "ShmSegment",
    "ShmSegmentNotFoundError",
    "ShmSizeMismatchError",
    "ShmTransfer",
    "cuda_peer_copy_async",
    "nccl_get_unique_id",
    "nccl_library_candidates",
    "new_segment_name",
    "shm_receive",
    "shm_send",
]

ShmSegment = _kvx.ShmSegment
NcclUnavailableError: type[RuntimeError] = _kvx.NcclUnavailableError
CudaEvent: Any = getattr(_kvx, "CudaEvent", None)  # None in a build without CUDA

_SEGMENT_PREFIX = "psrl-kv"
_BITS_DTYPE = {2: np.int16, 4: np.int32}  # numpy view of a dtype numpy may lack (bf16)


# --- errors -------------------------------------------------------------------------------------------


class KVChannelError(Exception):
    """Base class of the errors a KV channel raises on its own."""


class ShmSegmentNotFoundError(KVChannelError, FileNotFoundError):
    """The shared-memory segment named by a transfer does not exist (never created, or already unlinked)."""


class ShmSizeMismatchError(KVChannelError, ValueError):
    """The segment's size differs from what its transfer descriptor says: a stale or foreign segment."""


class CudaUnavailableError(KVChannelError, RuntimeError):
    """psrl._kvx was built without CUDA, so CUDA IPC and NCCL channels are not available."""


def _require_cuda(what: str) -> None:
    if not HAS_CUDA:
        raise CudaUnavailableError(
            f"{what} needs psrl._kvx built with CUDA; this build has none (nvcc was not found when it was built)"
        )


# --- POSIX shared memory ------------------------------------------------------------------------------


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


def _host_view(buffer: Any, shape: tuple[int, ...], dtype: str, like: ArrayLike | None) -> ArrayLike:
    """Zero-copy view of a buffer-protocol object as a numpy array, or as a CPU torch tensor when the caches
    (``like``) are torch tensors or the dtype is one numpy lacks (bf16)."""
    torch_like = like is not None and not isinstance(like, np.ndarray)
    count = math.prod(shape)  # the buffer may be longer (a pooled segment): the view is its start
    if not torch_like and dtype != "bfloat16":
        return np.frombuffer(buffer, dtype=np.dtype(dtype), count=count).reshape(shape)
    torch = sys.modules.get("torch")
    if torch is None:
        raise KVLayoutMismatchError(f"a {dtype} buffer needs torch (numpy has no such dtype); import torch first")
    bits = np.frombuffer(buffer, dtype=_BITS_DTYPE[DTYPE_ITEMSIZE[dtype]], count=count)
    # torch.from_numpy keeps the numpy array, which keeps the buffer export, alive as long as the tensor.
    return torch.from_numpy(bits).view(getattr(torch, dtype)).reshape(shape)


def _open_segment(transfer: ShmTransfer) -> Any:
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


def _unmap(segment: Any) -> None:
    with contextlib.suppress(BufferError):  # a live view: unmapped when the last one goes
        segment.close()


def _destroy(segment: Any) -> None:
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
        self._idle: list[Any] = []  # mapped segments nobody uses, least recently used first
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

    def acquire(self, nbytes: int) -> Any:
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

    def release(self, segment: Any) -> None:
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

    def retire(self, segment: Any) -> None:
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

    def acquire(self, transfer: ShmTransfer) -> Any:
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

    def done(self, segment: Any) -> None:
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
        segment: Any,
        transfer: ShmTransfer,
        *,
        release: Callable[[Any], None] | None = None,
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
    def segment(self) -> Any:
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
    ids = np.asarray(block_ids)
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


# --- CUDA IPC -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Device:
    """Just enough of torch.device for psrl.kv.blocks."""

    index: int
    type: str = "cuda"


@dataclass(frozen=True)
class DeviceArray:
    """A contiguous device buffer given by a raw pointer (e.g. a peer's memory opened through CUDA IPC),
    shaped like a torch CUDA tensor so ``psrl.kv.gather_blocks(out=...)`` / ``scatter_blocks`` accept it."""

    ptr: int
    shape: tuple[int, ...]
    dtype: str
    device_index: int
    is_cuda: bool = field(default=True, init=False)

    @property
    def device(self) -> _Device:
        return _Device(self.device_index)

    def data_ptr(self) -> int:
        return self.ptr

    def element_size(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    def stride(self) -> tuple[int, ...]:
        strides, step = [], 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= size
        return tuple(reversed(strides))


def _torch_stream(device: int, stream: int | None) -> int:
    """``stream`` or torch's current stream on ``device`` (the legacy default stream without torch)."""
    if stream is not None:
        return int(stream)
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    return int(torch.cuda.current_stream(device).cuda_stream)


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CudaIpcDescriptor:
    """What a peer process needs to open an exported device buffer: send it over any control channel."""

    handle: bytes  # cudaIpcMemHandle_t of the allocation holding the buffer
    offset: int  # bytes from the allocation's base to the buffer
    shape: tuple[int, ...]
    dtype: str
    device: int  # the exporter's device index (the opener may see it under another index)
    event_handle: bytes | None = None  # interprocess event recorded after the exporter's writes
    num_tokens: int | None = None  # for KV buffers: as ShmTransfer.num_tokens

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return {
            "handle": self.handle.hex(),
            "offset": self.offset,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "device": self.device,
            "event_handle": None if self.event_handle is None else self.event_handle.hex(),
            "num_tokens": self.num_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CudaIpcDescriptor:
        event = data.get("event_handle")
        num_tokens = data.get("num_tokens")
        return cls(
            handle=bytes.fromhex(data["handle"]),
            offset=int(data["offset"]),
            shape=tuple(int(n) for n in data["shape"]),
            dtype=str(data["dtype"]),
            device=int(data["device"]),
            event_handle=None if event is None else bytes.fromhex(event),
            num_tokens=None if num_tokens is None else int(num_tokens),
        )


class CudaIpcExport:
    """Exporter side: keeps a contiguous CUDA tensor (and the event marking its writes) alive while a peer
    uses it. :meth:`record` (done at construction) marks everything enqueued so far on ``stream`` as what
    the peer must wait for; close the export only after the peer says it has finished with the buffer."""

    def __init__(self, tensor: Any, *, stream: int | None = None, num_tokens: int | None = None) -> None:
        _require_cuda("CUDA IPC")
        if not getattr(tensor, "is_cuda", False):
            raise ValueError("CUDA IPC exports CUDA tensors only")
        if not tensor.is_contiguous():
            raise ValueError("CUDA IPC exports contiguous tensors only")
        device = int(tensor.device.index if tensor.device.index is not None else 0)
        handle, offset, _, device = _kvx.cuda_ipc_export(int(tensor.data_ptr()), device)
        self._tensor = tensor
        self._event = _kvx.CudaEvent(device, True)
        self.descriptor = CudaIpcDescriptor(
            handle=bytes(handle),
            offset=int(offset),
            shape=tuple(int(n) for n in tensor.shape),
            dtype=_dtype_name(tensor),
            device=int(device),
            event_handle=bytes(self._event.ipc_handle()),
            num_tokens=num_tokens,
        )
        self.record(stream)

    def record(self, stream: int | None = None) -> None:
        """Record the interprocess event on ``stream`` (default: torch's current stream)."""
        self._event.record(_torch_stream(self.descriptor.device, stream))

    def close(self) -> None:
        self._event.destroy()
        self._tensor = None

    def __enter__(self) -> CudaIpcExport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CudaIpcBuffer:
    """Opener side: a peer's exported buffer mapped into this process (``cudaIpcOpenMemHandle``)."""

    def __init__(self, descriptor: CudaIpcDescriptor, device: int = 0) -> None:
        _require_cuda("CUDA IPC")
        self.descriptor = descriptor
        self.device = int(device)
        self._base = int(_kvx.cuda_ipc_open(descriptor.handle, self.device))
        self._event: Any = None
        try:
            if descriptor.event_handle is not None:
                self._event = _kvx.CudaEvent.from_ipc_handle(descriptor.event_handle, self.device)
        except BaseException:
            _kvx.cuda_ipc_close(self._base, self.device)
            raise

    @classmethod
    def open(cls, descriptor: CudaIpcDescriptor, device: int = 0) -> CudaIpcBuffer:
        return cls(descriptor, device)

    @property
    def closed(self) -> bool:
        return self._base == 0

    @property
    def ptr(self) -> int:
        if self.closed:
            raise ValueError("the CUDA IPC buffer is closed")
        return self._base + self.descriptor.offset

    def as_array(self) -> DeviceArray:
        """The peer's buffer as a tensor-like psrl.kv's gather/scatter accept (no copy)."""
        return DeviceArray(self.ptr, self.descriptor.shape, self.descriptor.dtype, self.device)

    def wait(self, stream: int | None = None) -> None:
        """Make ``stream`` wait for the exporter's recorded writes (the host does not wait)."""
        if self._event is not None:
            self._event.wait(_torch_stream(self.device, stream))

    def _done_event(self, stream: int) -> Any:
        done = _kvx.CudaEvent(self.device, False)
        done.record(stream)
        return done

    def scatter(self, layer_caches: Sequence[ArrayLike], block_ids: BlockIds, *, stream: int | None = None) -> Any:
        """Scatter the peer's buffer into ``block_ids`` of local CUDA caches with one kernel reading peer
        memory, after the exporter's event; returns a CudaEvent recorded after the kernel."""
        cuda_stream = _torch_stream(self.device, stream)
        self.wait(cuda_stream)
        scatter_blocks(
            self.as_array(), layer_caches, block_ids, stream=cuda_stream, num_tokens=self.descriptor.num_tokens
        )
        return self._done_event(cuda_stream)

    def gather(self, layer_caches: Sequence[ArrayLike], block_ids: BlockIds, *, stream: int | None = None) -> Any:
        """Gather ``block_ids`` of local CUDA caches straight into the peer's buffer (one kernel writing peer
        memory); returns a CudaEvent recorded after the kernel."""
        cuda_stream = _torch_stream(self.device, stream)
        self.wait(cuda_stream)
        gather_blocks(
            layer_caches, block_ids, out=self.as_array(), stream=cuda_stream, num_tokens=self.descriptor.num_tokens
        )
        return self._done_event(cuda_stream)

    def copy_to(self, tensor: Any, *, stream: int | None = None) -> Any:
        """``cudaMemcpyPeerAsync`` the peer's buffer into a local contiguous CUDA tensor of the same size,
        after the exporter's event; returns a CudaEvent recorded after the copy."""
        if not getattr(tensor, "is_cuda", False) or not tensor.is_contiguous():
            raise ValueError("copy_to needs a contiguous CUDA tensor")
        nbytes = int(tensor.numel()) * int(tensor.element_size())
        if nbytes != self.descriptor.nbytes:
            raise KVLayoutMismatchError(f"copy_to: tensor has {nbytes} bytes, the peer buffer {self.descriptor.nbytes}")
        dst_device = int(tensor.device.index if tensor.device.index is not None else 0)
        cuda_stream = _torch_stream(dst_device, stream)
        self.wait(cuda_stream)
        return cuda_peer_copy_async(
            int(tensor.data_ptr()), dst_device, self.ptr, self.device, nbytes, stream=cuda_stream
        )

    def close(self) -> None:
        """Close the mapping (enqueued work that reads it must be done: wait on its event first)."""
        if self._event is not None:
            self._event.destroy()
            self._event = None
        if self._base:
            base, self._base = self._base, 0
            _kvx.cuda_ipc_close(base, self.device)

    def __enter__(self) -> CudaIpcBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cuda_peer_copy_async(
    dst: int, dst_device: int, src: int, src_device: int, nbytes: int, *, stream: int | None = None
) -> Any:
    """``cudaMemcpyPeerAsync`` of raw device pointers on ``stream`` (default: torch's current stream on
    dst_device); returns a CudaEvent recorded after the copy to wait on."""
    _require_cuda("cuda_peer_copy_async")
    cuda_stream = _torch_stream(dst_device, stream)
    return _kvx.cuda_peer_copy_async(dst, dst_device, src, src_device, nbytes, cuda_stream, dst_device)


# --- NCCL ---------------------------------------------------------------------------------------------


def nccl_library_candidates(library: str | os.PathLike[str] | None = None) -> list[str]:
    """Paths tried before the loader's default ``libnccl.so.2``: ``library``, ``$PSRL_NCCL_LIBRARY``, then
    ``nvidia/nccl/lib/libnccl.so.2`` of an installed ``nvidia-nccl-cu*`` wheel."""
    candidates = [str(library)] if library is not None else []
    env = os.environ.get("PSRL_NCCL_LIBRARY")
    if env:
        candidates.append(env)
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / "lib" / "libnccl.so.2"
        if path.exists():
            candidates.append(str(path))
    return candidates


def nccl_get_unique_id(library: str | os.PathLike[str] | None = None) -> bytes:
    """``ncclGetUniqueId`` (128 bytes) for rank 0 to hand to the other ranks; NcclUnavailableError if no
    NCCL library loads."""
    return bytes(_kvx.nccl_get_unique_id(nccl_library_candidates(library)))


class NcclChannel:
    """A point-to-point NCCL communicator for KV buffers between replicas on different nodes.

    Every rank builds one with the same ``unique_id`` (from :func:`nccl_get_unique_id` on one rank) and
    world size; construction blocks until all have joined. Sends and receives are enqueued on a CUDA stream
    (default: torch's current stream) and never wait on the host.
    """

    def __init__(
        self,
        unique_id: bytes,
        world_size: int,
        rank: int,
        device: int = 0,
        *,
        library: str | os.PathLike[str] | None = None,
    ) -> None:
        _require_cuda("the NCCL channel")
        candidates = nccl_library_candidates(library)
        self._comm = _kvx.NcclCommunicator(bytes(unique_id), world_size, rank, device, candidates)

    @property
    def rank(self) -> int:
        return int(self._comm.rank)

    @property
    def world_size(self) -> int:
        return int(self._comm.world_size)

    @property
    def device(self) -> int:
        return int(self._comm.device)

    @property
    def closed(self) -> bool:
        return bool(self._comm.closed)

    def send(self, ptr: int, nbytes: int, peer: int, stream: int | None = None) -> None:
        self._comm.send(ptr, nbytes, peer, _torch_stream(self.device, stream))

    def recv(self, ptr: int, nbytes: int, peer: int, stream: int | None = None) -> None:
        self._comm.recv(ptr, nbytes, peer, _torch_stream(self.device, stream))

    def send_tensor(self, tensor: Any, peer: int, stream: int | None = None) -> None:
        self.send(int(tensor.data_ptr()), _contiguous_cuda_nbytes(tensor), peer, stream)

    def recv_tensor(self, tensor: Any, peer: int, stream: int | None = None) -> None:
        self.recv(int(tensor.data_ptr()), _contiguous_cuda_nbytes(tensor), peer, stream)

    def send_blocks(
        self,
        layer_caches: Sequence[ArrayLike],
        block_ids: BlockIds,
        peer: int,
        *,
        num_tokens: int | None = None,
        stream: int | None = None,
    ) -> Any:
        """Gather ``block_ids`` of CUDA caches into a new buffer and send it, both on ``stream``. Returns the
        buffer: keep it alive until the stream has passed the send (or use torch's current stream)."""
        cuda_stream = _torch_stream(self.device, stream)
        buffer = gather_blocks(layer_caches, block_ids, stream=cuda_stream, num_tokens=num_tokens)
        self.send_tensor(buffer, peer, cuda_stream)
        return buffer

    def recv_blocks(
        self,
        layer_caches: Sequence[ArrayLike],
        block_ids: BlockIds,
        peer: int,
        *,
        num_tokens: int | None = None,
        stream: int | None = None,
    ) -> Any:
        """Receive a buffer from ``peer`` and scatter it into ``block_ids`` of CUDA caches, both on
        ``stream``; returns the buffer (same lifetime rule as :meth:`send_blocks`)."""
        layout = describe_kv_cache(layer_caches)
        ids = np.asarray(block_ids)
        cuda_stream = _torch_stream(self.device, stream)
        buffer = layer_caches[0].new_empty(layout.buffer_shape(len(ids)))
        self.recv_tensor(buffer, peer, cuda_stream)
        scatter_blocks(buffer, layer_caches, ids, stream=cuda_stream, num_tokens=num_tokens)
        return buffer

    def close(self, *, abort: bool = False) -> None:
        self._comm.destroy(abort)

    def __enter__(self) -> NcclChannel:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(abort=exc_type is not None)


def _contiguous_cuda_nbytes(tensor: Any) -> int:
    if not getattr(tensor, "is_cuda", False) or not tensor.is_contiguous():
        raise ValueError("NCCL sends and receives contiguous CUDA tensors only")
    return int(tensor.numel()) * int(tensor.element_size())

"""CUDA IPC between processes on one node: :class:`CudaIpcExport` / :class:`CudaIpcBuffer`.

One side exports a device buffer (and an interprocess event that marks its writes done), the other opens it
and scatters out of (or gathers into) the peer's memory with the one-launch kernels, or copies it with
``cudaMemcpyPeerAsync``. Only streams and events order the work: no device-wide synchronisation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from psrl import _kvx
from psrl.kv.blocks import DTYPE_ITEMSIZE, ArrayLike, BlockIds, KVLayoutMismatchError, gather_blocks, scatter_blocks
from psrl.kv.channels.base import require_cuda, torch_stream

if TYPE_CHECKING:
    import torch

__all__ = ["CudaEvent", "CudaIpcBuffer", "CudaIpcDescriptor", "CudaIpcExport", "DeviceArray", "cuda_peer_copy_async"]

CudaEvent: type[_kvx.CudaEvent] | None = getattr(_kvx, "CudaEvent", None)  # None in a build without CUDA


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


def _dtype_name(tensor: torch.Tensor) -> str:
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

    def __init__(self, tensor: torch.Tensor, *, stream: int | None = None, num_tokens: int | None = None) -> None:
        require_cuda("CUDA IPC")
        if not getattr(tensor, "is_cuda", False):
            raise ValueError("CUDA IPC exports CUDA tensors only")
        if not tensor.is_contiguous():
            raise ValueError("CUDA IPC exports contiguous tensors only")
        device = int(tensor.device.index if tensor.device.index is not None else 0)
        handle, offset, _, device = _kvx.cuda_ipc_export(int(tensor.data_ptr()), device)
        self._tensor: torch.Tensor | None = tensor
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
        self._event.record(torch_stream(self.descriptor.device, stream))

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
        require_cuda("CUDA IPC")
        self.descriptor = descriptor
        self.device = int(device)
        self._base = int(_kvx.cuda_ipc_open(descriptor.handle, self.device))
        self._event: _kvx.CudaEvent | None = None
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
            self._event.wait(torch_stream(self.device, stream))

    def _done_event(self, stream: int) -> _kvx.CudaEvent:
        done = _kvx.CudaEvent(self.device, False)
        done.record(stream)
        return done

    def scatter(
        self, layer_caches: Sequence[ArrayLike], block_ids: BlockIds, *, stream: int | None = None
    ) -> _kvx.CudaEvent:
        """Scatter the peer's buffer into ``block_ids`` of local CUDA caches with one kernel reading peer
        memory, after the exporter's event; returns a CudaEvent recorded after the kernel."""
        cuda_stream = torch_stream(self.device, stream)
        self.wait(cuda_stream)
        scatter_blocks(
            self.as_array(), layer_caches, block_ids, stream=cuda_stream, num_tokens=self.descriptor.num_tokens
        )
        return self._done_event(cuda_stream)

    def gather(
        self, layer_caches: Sequence[ArrayLike], block_ids: BlockIds, *, stream: int | None = None
    ) -> _kvx.CudaEvent:
        """Gather ``block_ids`` of local CUDA caches straight into the peer's buffer (one kernel writing peer
        memory); returns a CudaEvent recorded after the kernel."""
        cuda_stream = torch_stream(self.device, stream)
        self.wait(cuda_stream)
        gather_blocks(
            layer_caches, block_ids, out=self.as_array(), stream=cuda_stream, num_tokens=self.descriptor.num_tokens
        )
        return self._done_event(cuda_stream)

    def copy_to(self, tensor: torch.Tensor, *, stream: int | None = None) -> _kvx.CudaEvent:
        """``cudaMemcpyPeerAsync`` the peer's buffer into a local contiguous CUDA tensor of the same size,
        after the exporter's event; returns a CudaEvent recorded after the copy."""
        if not getattr(tensor, "is_cuda", False) or not tensor.is_contiguous():
            raise ValueError("copy_to needs a contiguous CUDA tensor")
        nbytes = int(tensor.numel()) * int(tensor.element_size())
        if nbytes != self.descriptor.nbytes:
            raise KVLayoutMismatchError(f"copy_to: tensor has {nbytes} bytes, the peer buffer {self.descriptor.nbytes}")
        dst_device = int(tensor.device.index if tensor.device.index is not None else 0)
        cuda_stream = torch_stream(dst_device, stream)
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
) -> _kvx.CudaEvent:
    """``cudaMemcpyPeerAsync`` of raw device pointers on ``stream`` (default: torch's current stream on
    dst_device); returns a CudaEvent recorded after the copy to wait on."""
    require_cuda("cuda_peer_copy_async")
    cuda_stream = torch_stream(dst_device, stream)
    return _kvx.cuda_peer_copy_async(dst, dst_device, src, src_device, nbytes, cuda_stream, dst_device)

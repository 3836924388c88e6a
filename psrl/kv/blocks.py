"""Typed gather/scatter of paged KV-cache blocks for KV migration between engines.

Moves the blocks named by a block-id list, all layers at once, between per-layer paged caches
(vLLM FlashAttention layout ``[2, num_blocks, block_size, num_kv_heads, head_size]``, NHD or HND strides) and
one contiguous ``[num_layers, 2, num_ids, block_size, num_kv_heads, head_size]`` buffer, over the native
``psrl._kvx`` module; ``num_tokens`` moves only the filled part of a partial last block. Accepts numpy arrays
and torch tensors (duck-typed; torch is never imported here): host memory takes the threaded memcpy path,
CUDA tensors the one-kernel CUDA path.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol, TypeAlias, TypeVar, cast, overload

import numpy as np
import numpy.typing as npt

import psrl._kvx as _kvx  # typed by psrl/_kvx.pyi

__all__ = [
    "HAS_CUDA",
    "ArrayLike",
    "BlockIds",
    "DeviceLike",
    "KVCacheLayout",
    "KVLayoutMismatchError",
    "TensorLike",
    "buffer_shape",
    "describe_kv_cache",
    "gather_blocks",
    "scatter_blocks",
    "transfer_nbytes",
]

HAS_CUDA: bool = bool(_kvx.HAS_CUDA)


class DeviceLike(Protocol):
    """What psrl.kv reads of a ``torch.device``."""

    @property
    def type(self) -> str: ...

    @property
    def index(self) -> int | None: ...


class TensorLike(Protocol):
    """What psrl.kv reads of a torch tensor (CPU or CUDA), or of a tensor-like such as
    ``psrl.kv.channels.DeviceArray``: torch is never imported here."""

    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def dtype(self) -> object: ...  # its str() is "torch.float16", "torch.bfloat16", ...

    @property
    def device(self) -> DeviceLike: ...

    @property
    def is_cuda(self) -> bool: ...

    def data_ptr(self) -> int: ...

    def element_size(self) -> int: ...

    def stride(self) -> tuple[int, ...]: ...  # in elements


# A cache or a transfer buffer: a numpy array or a tensor (see _TensorView for what is read from it).
ArrayLike: TypeAlias = npt.NDArray[Any] | TensorLike
# gather_blocks returns the kind of array it was given (its ``out``, or one like the caches).
ArrayT = TypeVar("ArrayT", bound=ArrayLike)
# Block ids: ints, a 1-D integer numpy array, or a 1-D integer torch tensor.
BlockIds: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]] | TensorLike

# The dtypes the copies move (by element size: the copies never look at the values).
DTYPE_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
_SUPPORTED_ITEMSIZES = frozenset(DTYPE_ITEMSIZE.values())


@dataclass(frozen=True)
class _TensorView:
    """What the native module needs from one numpy array or torch tensor."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    itemsize: int
    dtype: str  # "float16", "bfloat16", "float32", ... the same for numpy and torch
    cuda_device: int | None  # None: host memory
    writeable: bool = True


def _is_torch_tensor(obj: object) -> bool:
    return hasattr(obj, "data_ptr") and hasattr(obj, "element_size") and hasattr(obj, "is_cuda")


def _view(obj: object, name: str) -> _TensorView:
    if isinstance(obj, np.ndarray):
        itemsize = int(obj.itemsize)
        if any(s % itemsize for s in obj.strides):
            raise ValueError(f"{name}: strides {obj.strides} are not whole elements of {itemsize} bytes")
        return _TensorView(
            ptr=int(obj.ctypes.data),
            shape=tuple(int(n) for n in obj.shape),
            strides=tuple(int(s) // itemsize for s in obj.strides),
            itemsize=itemsize,
            dtype=str(obj.dtype),
            cuda_device=None,
            writeable=bool(obj.flags.writeable),
        )
    if _is_torch_tensor(obj):
        obj = cast(TensorLike, obj)
        device = obj.device
        if obj.is_cuda:
            cuda_device: int | None = int(device.index) if device.index is not None else 0
        elif getattr(device, "type", "cpu") == "cpu":
            cuda_device = None
        else:
            raise ValueError(f"{name}: tensors on device {device} are not supported (cpu or cuda only)")
        return _TensorView(
            ptr=int(obj.data_ptr()),
            shape=tuple(int(n) for n in obj.shape),
            strides=tuple(int(s) for s in obj.stride()),
            itemsize=int(obj.element_size()),
            dtype=str(obj.dtype).removeprefix("torch."),
            cuda_device=cuda_device,
        )
    raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(obj).__name__}")


def _is_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    if 0 in shape:
        return True  # an empty array has no layout to get wrong
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _where(device: int | None) -> str:
    return "host memory" if device is None else f"cuda:{device}"


@dataclass(frozen=True)
class KVCacheLayout:
    """Shape, strides and placement shared by every layer of a paged KV cache."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    itemsize: int
    kv_stride: int  # elements between the K and V halves
    block_stride: int  # elements between consecutive blocks
    token_stride: int  # elements between consecutive tokens of a block (NHD: num_kv_heads * head_size)
    head_stride: int  # elements between consecutive heads of a token (NHD: head_size; HND: block_size * head_size)
    dtype: str  # e.g. "float16", "bfloat16", "float32"
    cuda_device: int | None  # None: host memory
    layer_ptrs: tuple[int, ...]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one half (K or V) of one layer."""
        return self.block_size * self.num_kv_heads * self.head_size * self.itemsize

    @property
    def kv_layout(self) -> str:
        """Stride order inside a block: NHD (heads inside tokens), HND (tokens inside heads) or strided."""
        nhd_token = self.num_kv_heads * self.head_size
        if (self.block_size == 1 or self.token_stride == nhd_token) and (
            self.num_kv_heads == 1 or self.head_stride == self.head_size
        ):
            return "NHD"
        if (self.num_kv_heads == 1 or self.head_stride == self.block_size * self.head_size) and (
            self.block_size == 1 or self.token_stride == self.head_size
        ):
            return "HND"
        return "strided"

    def buffer_shape(self, num_ids: int) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, 2, num_ids, self.block_size, self.num_kv_heads, self.head_size)

    @cached_property
    def native(self) -> _kvx.KVCacheLayout:
        """This layout as psrl._kvx's copies take it, checked there (built on first use, once)."""
        return _kvx.KVCacheLayout(
            list(self.layer_ptrs),
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_size,
            self.itemsize,
            self.kv_stride,
            self.block_stride,
            self.token_stride,
            self.head_stride,
        )

    def transfer_nbytes(self, num_ids: int) -> int:
        return self.num_layers * 2 * num_ids * self.block_nbytes


def describe_kv_cache(layer_caches: Sequence[ArrayLike]) -> KVCacheLayout:
    """Validate per-layer caches of shape [2, num_blocks, block_size, num_kv_heads, head_size]."""
    if len(layer_caches) == 0:
        raise ValueError("layer_caches is empty: need at least one layer")
    views = [_view(cache, f"layer_caches[{i}]") for i, cache in enumerate(layer_caches)]
    first = views[0]
    if len(first.shape) != 5 or first.shape[0] != 2:
        raise ValueError(
            "layer_caches[0]: expected shape [2, num_blocks, block_size, num_kv_heads, head_size], "
            f"got {list(first.shape)}"
        )
    _, num_blocks, block_size, num_kv_heads, head_size = first.shape
    if first.itemsize not in _SUPPORTED_ITEMSIZES:
        raise ValueError(
            f"layer_caches[0]: dtype {first.dtype} has itemsize {first.itemsize}; "
            "only 2-byte (fp16/bf16) and 4-byte (fp32) elements are supported"
        )
    for i, view in enumerate(views):
        if view.shape != first.shape:
            raise ValueError(f"layer_caches[{i}]: shape {list(view.shape)} differs from layer 0 {list(first.shape)}")
        if view.dtype != first.dtype:
            raise ValueError(f"layer_caches[{i}]: dtype {view.dtype} differs from layer 0 {first.dtype}")
        if view.strides[:2] != first.strides[:2]:
            raise ValueError(
                f"layer_caches[{i}]: kv/block strides {list(view.strides[:2])} differ from layer 0 "
                f"{list(first.strides[:2])}"
            )
        if any(size > 1 and view.strides[d] != first.strides[d] for d, size in ((2, block_size), (3, num_kv_heads))):
            raise ValueError(
                f"layer_caches[{i}]: token/head strides {list(view.strides[2:4])} differ from layer 0 "
                f"{list(first.strides[2:4])}"
            )
        if view.cuda_device != first.cuda_device:
            raise ValueError(
                f"layer_caches[{i}]: lives in {_where(view.cuda_device)}, layer 0 in {_where(first.cuda_device)}"
            )
        if view.shape[4] != 1 and view.strides[4] != 1:
            raise ValueError(
                f"layer_caches[{i}]: each head's head_size elements must be contiguous, "
                f"got inner strides {list(view.strides[2:])} for shape {list(view.shape[2:])}"
            )
    return KVCacheLayout(
        num_layers=len(views),
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        itemsize=first.itemsize,
        kv_stride=first.strides[0],
        block_stride=first.strides[1],
        token_stride=first.strides[2],
        head_stride=first.strides[3],
        dtype=first.dtype,
        cuda_device=first.cuda_device,
        layer_ptrs=tuple(view.ptr for view in views),
    )


def buffer_shape(layer_caches: Sequence[ArrayLike], num_ids: int) -> tuple[int, int, int, int, int, int]:
    """Shape of the contiguous transfer buffer for num_ids blocks of these caches."""
    return describe_kv_cache(layer_caches).buffer_shape(num_ids)


def transfer_nbytes(layer_caches: Sequence[ArrayLike], num_ids: int) -> int:
    """Bytes moved when gathering or scattering num_ids blocks of these caches."""
    return describe_kv_cache(layer_caches).transfer_nbytes(num_ids)


def _as_block_ids(block_ids: BlockIds) -> npt.NDArray[np.int64]:
    source: Any = block_ids
    if _is_torch_tensor(source):
        source = source.detach().cpu().numpy()
    ids = np.asarray(source)
    if ids.ndim != 1:
        raise ValueError(f"block_ids must be one-dimensional, got shape {list(ids.shape)}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"block_ids must be integers, got dtype {ids.dtype}")
    return np.ascontiguousarray(ids, dtype=np.int64)


def _last_block_tokens(num_tokens: int | None, num_ids: int, block_size: int) -> int | None:
    """Tokens of the last block that move, from the tokens held by all num_ids blocks (None: all)."""
    if num_tokens is None:
        return None
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int | np.integer):
        raise TypeError(f"num_tokens must be an int or None, got {type(num_tokens).__name__}")
    num_tokens = int(num_tokens)
    if num_ids == 0:
        if num_tokens != 0:
            raise ValueError(f"num_tokens={num_tokens} but no block ids")
        return None
    low, high = (num_ids - 1) * block_size + 1, num_ids * block_size
    if not low <= num_tokens <= high:
        raise ValueError(
            f"num_tokens={num_tokens} does not fit {num_ids} blocks of {block_size} tokens (need {low}..{high})"
        )
    return num_tokens - (num_ids - 1) * block_size


class KVLayoutMismatchError(ValueError):
    """A transfer buffer that does not fit the caches: another shape (layers, heads, block size, block count)
    or dtype. Raised wherever a buffer meets caches, so every channel reports it the same way."""


def _check_buffer(buffer: _TensorView, layout: KVCacheLayout, num_ids: int, name: str) -> None:
    if buffer.cuda_device != layout.cuda_device:
        raise ValueError(f"{name}: lives in {_where(buffer.cuda_device)}, the cache in {_where(layout.cuda_device)}")
    expected = layout.buffer_shape(num_ids)
    if buffer.shape != expected:
        raise KVLayoutMismatchError(
            f"{name}: shape {list(buffer.shape)}, but these caches and {num_ids} block ids need {list(expected)}"
        )
    if buffer.dtype != layout.dtype:
        raise KVLayoutMismatchError(f"{name}: dtype {buffer.dtype} differs from the cache dtype {layout.dtype}")
    if not _is_contiguous(buffer.shape, buffer.strides):
        raise ValueError(f"{name}: must be contiguous")


def _current_stream(device: int) -> int:
    # The caches are torch tensors, so torch is already imported; use its current stream.
    torch = sys.modules["torch"]
    return int(torch.cuda.current_stream(device).cuda_stream)


def _copy(
    layout: KVCacheLayout,
    ids: npt.NDArray[np.int64],
    buffer: _TensorView,
    gather: bool,
    num_threads: int | None,
    stream: int | None,
    last_block_tokens: int | None,
) -> None:
    nbytes = layout.transfer_nbytes(len(ids))
    if layout.cuda_device is None:
        host_copy = _kvx.gather_blocks if gather else _kvx.scatter_blocks
        host_copy(layout.native, ids, buffer.ptr, nbytes, 0 if num_threads is None else num_threads, last_block_tokens)
        return
    if not HAS_CUDA:
        raise RuntimeError("psrl._kvx was built without CUDA; rebuild with nvcc available for CUDA tensors")
    device = layout.cuda_device
    cuda_stream = _current_stream(device) if stream is None else stream
    cuda_copy = _kvx.cuda_gather_blocks if gather else _kvx.cuda_scatter_blocks
    cuda_copy(layout.native, ids, buffer.ptr, nbytes, device, cuda_stream, last_block_tokens)


@overload
def gather_blocks(
    layer_caches: Sequence[ArrayLike],
    block_ids: BlockIds,
    out: ArrayT,
    num_threads: int | None = None,
    stream: int | None = None,
    num_tokens: int | None = None,
) -> ArrayT: ...


@overload
def gather_blocks(
    layer_caches: Sequence[ArrayT],
    block_ids: BlockIds,
    out: None = None,
    num_threads: int | None = None,
    stream: int | None = None,
    num_tokens: int | None = None,
) -> ArrayT: ...


def gather_blocks(
    layer_caches: Sequence[ArrayLike],
    block_ids: BlockIds,
    out: ArrayLike | None = None,
    num_threads: int | None = None,
    stream: int | None = None,
    num_tokens: int | None = None,
) -> ArrayLike:
    """Copy blocks ``block_ids`` (repeats allowed) of every layer into one contiguous buffer.

    Returns ``out`` (or a new array of the cache's kind, dtype and device) of shape
    ``[num_layers, 2, len(block_ids), block_size, num_kv_heads, head_size]``. For CUDA tensors the copy
    is enqueued on ``stream`` (default: torch's current stream) and not synchronized. ``num_threads``
    only applies to host memory (None: min(cpu count, 8)). ``num_tokens`` (None: every block full) is how
    many tokens the blocks hold in order: only the first ``num_tokens - (len(block_ids) - 1) * block_size``
    tokens of the last block are copied and the rest of its slot in the buffer is zeroed.
    """
    return _gather(describe_kv_cache(layer_caches), layer_caches, block_ids, out, num_threads, stream, num_tokens)


def _gather(
    layout: KVCacheLayout,
    layer_caches: Sequence[ArrayLike],
    block_ids: BlockIds,
    out: ArrayLike | None,
    num_threads: int | None,
    stream: int | None,
    num_tokens: int | None,
) -> ArrayLike:
    """gather_blocks for a caller that has just described these very caches (psrl.kv.channels.shm_send)."""
    ids = _as_block_ids(block_ids)
    if out is None:
        out = _new_buffer(layer_caches[0], layout.buffer_shape(len(ids)))
    buffer = _view(out, "out")
    _check_buffer(buffer, layout, len(ids), "out")
    last_block_tokens = _last_block_tokens(num_tokens, len(ids), layout.block_size)
    if not buffer.writeable:
        raise ValueError("out: array is read-only")
    _copy(layout, ids, buffer, True, num_threads, stream, last_block_tokens)
    return out


def scatter_blocks(
    buffer: ArrayLike,
    layer_caches: Sequence[ArrayLike],
    block_ids: BlockIds,
    num_threads: int | None = None,
    stream: int | None = None,
    num_tokens: int | None = None,
) -> None:
    """Copy a buffer laid out as ``gather_blocks`` returns into blocks ``block_ids`` of every layer.

    ``block_ids`` must be distinct (a repeat would make the result depend on copy order). ``num_tokens``
    as for ``gather_blocks``: the tokens of the last block past it are left untouched in the cache.
    """
    _scatter(describe_kv_cache(layer_caches), buffer, layer_caches, block_ids, num_threads, stream, num_tokens)


def _scatter(
    layout: KVCacheLayout,
    buffer: ArrayLike,
    layer_caches: Sequence[ArrayLike],
    block_ids: BlockIds,
    num_threads: int | None,
    stream: int | None,
    num_tokens: int | None,
) -> None:
    """scatter_blocks for a caller that has just described these very caches (psrl.kv.channels.nccl)."""
    for i, cache in enumerate(layer_caches):
        if isinstance(cache, np.ndarray) and not cache.flags.writeable:
            raise ValueError(f"layer_caches[{i}]: array is read-only")
    ids = _as_block_ids(block_ids)
    view = _view(buffer, "buffer")
    _check_buffer(view, layout, len(ids), "buffer")
    last_block_tokens = _last_block_tokens(num_tokens, len(ids), layout.block_size)
    _copy(layout, ids, view, False, num_threads, stream, last_block_tokens)


def _new_buffer(like: ArrayLike, shape: tuple[int, ...]) -> ArrayLike:
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype=like.dtype)
    return cast(Any, like).new_empty(shape)  # torch: same dtype and device, no torch import needed

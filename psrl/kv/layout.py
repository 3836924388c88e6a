"""Static KV-cache layout descriptors, so two replicas can check compatibility before a block transfer.

``blocks.KVCacheLayout`` describes one live cache (pointers, strides, num_blocks, device) for the copy
kernels (the same name in ``psrl._kvx``); ``KVCacheSpec`` here (named after vLLM's) is the part two replicas
must agree on, without pointers or capacity: dtype, layer count, block geometry and the order inside a
block. It is JSON-able (``to_dict`` / ``from_dict``) for the handshake, and ``check_compatible`` raises a
typed ``LayoutMismatch`` naming the differing fields.

Every engine we serve keeps one tensor per layer, ``[2, num_blocks, *block_shape]`` (0 = K, 1 = V), with
one of two orders inside a block (``block_layout``):

* ``"NHD"`` blocks ``[block_size, num_kv_heads, head_size]``: the reference engine (``psrl.engine.kv_cache``)
  and vLLM's FlashAttention backend;
* ``"HND"`` blocks ``[num_kv_heads, block_size, head_size]``: vLLM's HND variants (e.g. FlashInfer with the
  HND stride order).

``blocks.describe_kv_cache`` takes every cache in the logical order ``[2, num_blocks, block_size,
num_kv_heads, head_size]`` (an HND cache as a ``transpose(2, 3)`` view) and reads the in-block order from
the strides; ``gather_blocks`` always fills an NHD-ordered buffer and ``scatter_blocks`` writes it back in
the destination's own strides. So the in-block order is local to each replica: ``check_compatible`` does
not compare it (it is in the spec to say how to allocate, ``layer_shape``). Describe the cache of one
tensor-parallel worker (its own KV heads).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from psrl.kv.blocks import ArrayLike, KVCacheLayout, describe_kv_cache

__all__ = [
    "BLOCK_LAYOUTS",
    "ENGINE_BLOCK_LAYOUTS",
    "LAYOUT_DICT_VERSION",
    "BlockLayout",
    "KVCacheSpec",
    "LayoutError",
    "LayoutMismatch",
    "check_compatible",
    "dtype_itemsize",
]

# "opaque": an in-block order private to the engine (vLLM's CPU backend packs K transposed beside V in each
# block), so the block is moved as raw bytes, whole, and only between two caches with that same layout.
BlockLayout = Literal["NHD", "HND", "opaque"]
BLOCK_LAYOUTS: tuple[str, ...] = get_args(BlockLayout)

# The in-block order of each engine's paged cache.
ENGINE_BLOCK_LAYOUTS: dict[str, BlockLayout] = {
    "reference": "NHD",  # psrl.engine.kv_cache.PagedKVCache
    "vllm-flash-attn": "NHD",  # vLLM FlashAttention backend
    "vllm-hnd": "HND",  # vLLM backends using the HND stride order
    "vllm-cpu": "opaque",  # vLLM's CPU backend: per layer [num_blocks, num_kv_heads, block_size, 2 * head_size]
}

LAYOUT_DICT_VERSION = 2  # 2: head_dim became head_size

_ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
}
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "fp16": "float16", "bf16": "bfloat16"}

# Fields check_compatible compares, in the order it reports them. Not block_layout: the transfer buffer is
# NHD whatever either cache's in-block order is.
_COMPARED = ("dtype", "num_layers", "num_kv_heads", "head_size", "block_size")


class LayoutError(ValueError):
    """An invalid layout descriptor (bad field value, malformed dict)."""


class LayoutMismatch(LayoutError):
    """Source and destination layouts differ; ``field`` is the first differing field.

    ``mismatches`` lists every differing field as ``(field, source value, destination value)``.
    """

    def __init__(self, mismatches: Sequence[tuple[str, object, object]]) -> None:
        self.mismatches = tuple(mismatches)
        self.field, self.src_value, self.dst_value = self.mismatches[0]
        detail = "; ".join(f"{name}: source {src!r} != destination {dst!r}" for name, src, dst in self.mismatches)
        super().__init__(f"KV cache layouts are not compatible: {detail}")


def _dtype_name(dtype: object) -> str:
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _ITEMSIZE:
        raise LayoutError(f"unsupported KV cache dtype {dtype!r}; expected one of {sorted(_ITEMSIZE)}")
    return name


def dtype_itemsize(dtype: object) -> int:
    """Bytes per element of a KV dtype ("float16", "bfloat16", torch.float32, np.dtype, ...)."""
    return _ITEMSIZE[_dtype_name(dtype)]


@dataclass(frozen=True)
class KVCacheSpec:
    """One replica's paged KV cache layout, without pointers or capacity (``check_compatible`` compares two)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str  # canonical torch name: "float16", "bfloat16", "float32", "float8_e4m3fn", ...
    block_layout: BlockLayout = "NHD"

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        if self.block_layout not in BLOCK_LAYOUTS:
            raise LayoutError(f"block_layout must be one of {list(BLOCK_LAYOUTS)}, got {self.block_layout!r}")

    # ---- construction ---------------------------------------------------------------------------------

    @classmethod
    def for_engine(
        cls, engine: str, *, num_layers: int, block_size: int, num_kv_heads: int, head_size: int, dtype: object
    ) -> KVCacheSpec:
        """The spec of a named engine's cache (see ENGINE_BLOCK_LAYOUTS)."""
        try:
            block_layout = ENGINE_BLOCK_LAYOUTS[engine]
        except KeyError:
            raise LayoutError(f"unknown engine {engine!r}; expected one of {sorted(ENGINE_BLOCK_LAYOUTS)}") from None
        return cls(num_layers, block_size, num_kv_heads, head_size, str(dtype), block_layout)

    @classmethod
    def from_kv_cache_layout(cls, layout: KVCacheLayout) -> KVCacheSpec:
        """The spec of a cache ``describe_kv_cache`` validated, its in-block order read from its strides."""
        order = layout.kv_layout
        if order not in BLOCK_LAYOUTS:
            raise LayoutError(f"the cache's in-block strides are {order}, neither NHD nor HND")
        block_layout: BlockLayout = "HND" if order == "HND" else "NHD"
        return cls(
            layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_size, layout.dtype, block_layout
        )

    @classmethod
    def describe(cls, layer_caches: Sequence[ArrayLike]) -> KVCacheSpec:
        """Validate per-layer caches (numpy or torch, logical order ``[2, num_blocks, block_size,
        num_kv_heads, head_size]``; an HND cache as a ``transpose(2, 3)`` view) and describe them."""
        return cls.from_kv_cache_layout(describe_kv_cache(layer_caches))

    # ---- shapes and sizes -----------------------------------------------------------------------------

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one half (K or V) of one layer."""
        if self.block_layout in ("NHD", "opaque"):  # an opaque block has the bytes of an NHD one
            return (self.block_size, self.num_kv_heads, self.head_size)
        return (self.num_kv_heads, self.block_size, self.head_size)

    def layer_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape to allocate one layer's cache tensor with ``num_blocks`` blocks in this block layout."""
        return (2, num_blocks, *self.block_shape)

    def buffer_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        """Shape of ``blocks.gather_blocks``' contiguous buffer for ``num_blocks`` blocks (NHD for either layout)."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token: all layers, K and V."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_size * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block, all layers, K and V (``KVCacheLayout.block_nbytes``: one half of one layer)."""
        return self.bytes_per_token * self.block_size

    def transfer_nbytes(self, num_blocks: int) -> int:
        """Bytes ``gather_blocks`` moves for ``num_blocks`` blocks."""
        return self.bytes_per_block * num_blocks

    # ---- wire form ------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form for the compatibility handshake."""
        return {"version": LAYOUT_DICT_VERSION, **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVCacheSpec:
        if not isinstance(data, Mapping):
            raise LayoutError(f"layout must be a mapping, got {type(data).__name__}")
        version = data.get("version")
        if version != LAYOUT_DICT_VERSION:
            raise LayoutError(f"unsupported layout dict version {version!r}; expected {LAYOUT_DICT_VERSION}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - {"version", *names})
        if unknown:
            raise LayoutError(f"unknown layout fields {unknown}")
        missing = [name for name in names if name not in data]
        if missing:
            raise LayoutError(f"layout dict is missing {missing}")
        return cls(**{name: data[name] for name in names})


def check_compatible(src: KVCacheSpec | Mapping[str, Any], dst: KVCacheSpec | Mapping[str, Any]) -> None:
    """Raise LayoutMismatch unless blocks gathered from ``src`` can be scattered into ``dst``.

    Either side may be a spec or its ``to_dict()`` form (as received from the peer). Compared: dtype,
    num_layers, num_kv_heads, head_size, block_size, and block_layout when either side is "opaque" (its bytes
    mean something only to a cache of the same layout; NHD and HND meet in the NHD buffer). Not compared:
    block counts (each replica has its own capacity).
    """
    src_spec = src if isinstance(src, KVCacheSpec) else KVCacheSpec.from_dict(src)
    dst_spec = dst if isinstance(dst, KVCacheSpec) else KVCacheSpec.from_dict(dst)
    mismatches = [
        (name, getattr(src_spec, name), getattr(dst_spec, name))
        for name in _COMPARED
        if getattr(src_spec, name) != getattr(dst_spec, name)
    ]
    if "opaque" in (src_spec.block_layout, dst_spec.block_layout) and src_spec.block_layout != dst_spec.block_layout:
        mismatches.append(("block_layout", src_spec.block_layout, dst_spec.block_layout))
    if mismatches:
        raise LayoutMismatch(mismatches)

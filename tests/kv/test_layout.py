"""psrl.kv.layout: layout descriptors, their wire form and the compatibility check."""

from __future__ import annotations

import json

import numpy as np
import pytest

from psrl.kv.blocks import describe_kv_cache
from psrl.kv.layout import (
    ENGINE_BLOCK_LAYOUTS,
    KVCacheSpec,
    LayoutError,
    LayoutMismatch,
    check_compatible,
    dtype_itemsize,
)


def spec(**overrides: object) -> KVCacheSpec:
    fields: dict[str, object] = {
        "num_layers": 28,
        "block_size": 16,
        "num_kv_heads": 8,
        "head_size": 128,
        "dtype": "bfloat16",
        "block_layout": "NHD",
    }
    fields.update(overrides)
    return KVCacheSpec(**fields)  # type: ignore[arg-type]


def test_sizes_and_shapes() -> None:
    s = spec()
    assert s.itemsize == 2
    assert s.bytes_per_token == 28 * 2 * 8 * 128 * 2  # 114,688 bytes: Qwen3-8B-like, bf16
    assert s.bytes_per_block == s.bytes_per_token * 16
    assert s.transfer_nbytes(3) == 3 * s.bytes_per_block
    assert s.block_shape == (16, 8, 128)
    assert s.layer_shape(100) == (2, 100, 16, 8, 128)
    assert s.buffer_shape(5) == (28, 2, 5, 16, 8, 128)
    hnd = spec(block_layout="HND")
    assert hnd.block_shape == (8, 16, 128)
    assert hnd.layer_shape(100) == (2, 100, 8, 16, 128)
    assert hnd.bytes_per_block == s.bytes_per_block
    assert spec(dtype="float32").bytes_per_token == 2 * s.bytes_per_token
    assert spec(dtype="float8_e4m3fn").bytes_per_token * 2 == s.bytes_per_token


@pytest.mark.parametrize(
    ("dtype", "name"),
    [("half", "float16"), ("torch.bfloat16", "bfloat16"), ("float", "float32"), (np.dtype(np.float16), "float16")],
)
def test_dtype_names_are_canonical(dtype: object, name: str) -> None:
    assert spec(dtype=dtype).dtype == name
    assert dtype_itemsize(dtype) == dtype_itemsize(name)


def test_torch_dtype() -> None:
    torch = pytest.importorskip("torch")
    assert spec(dtype=torch.bfloat16).dtype == "bfloat16"


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_layers", 0), ("block_size", -1), ("num_kv_heads", 2.0), ("head_size", True), ("dtype", "complex64"),
     ("block_layout", "NDH")],
)  # fmt: skip
def test_invalid_fields(field: str, value: object) -> None:
    with pytest.raises(LayoutError, match=field):
        spec(**{field: value})


def test_for_engine() -> None:
    kwargs = {"num_layers": 2, "block_size": 16, "num_kv_heads": 2, "head_size": 32, "dtype": "float32"}
    assert KVCacheSpec.for_engine("reference", **kwargs).block_layout == "NHD"  # type: ignore[arg-type]
    assert KVCacheSpec.for_engine("vllm-flash-attn", **kwargs).block_layout == "NHD"  # type: ignore[arg-type]
    assert KVCacheSpec.for_engine("vllm-hnd", **kwargs).block_layout == "HND"  # type: ignore[arg-type]
    assert KVCacheSpec.for_engine("vllm-cpu", **kwargs).block_layout == "opaque"  # type: ignore[arg-type]
    assert set(ENGINE_BLOCK_LAYOUTS) == {"reference", "vllm-flash-attn", "vllm-hnd", "vllm-cpu"}
    with pytest.raises(LayoutError, match="unknown engine"):
        KVCacheSpec.for_engine("sglang", **kwargs)  # type: ignore[arg-type]


def test_dict_round_trip_through_json() -> None:
    for s in (spec(), spec(block_layout="HND", dtype="float16", block_size=32)):
        wire = json.loads(json.dumps(s.to_dict()))
        assert wire["version"] == 2
        assert KVCacheSpec.from_dict(wire) == s


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.pop("version"), "version"),
        (lambda d: d.update(version=1), "version"),  # a peer from before head_dim became head_size
        (lambda d: d.pop("head_size"), "missing"),
        (lambda d: d.update(num_blocks=10), "unknown"),
        (lambda d: d.update(block_size=16.0), "block_size"),
    ],
)
def test_from_dict_rejects_malformed(mutate: object, match: str) -> None:
    data = spec().to_dict()
    mutate(data)  # type: ignore[operator]
    with pytest.raises(LayoutError, match=match):
        KVCacheSpec.from_dict(data)
    with pytest.raises(LayoutError, match="mapping"):
        KVCacheSpec.from_dict([1, 2])  # type: ignore[arg-type]


def test_check_compatible_accepts_equal_specs_and_dicts() -> None:
    check_compatible(spec(), spec())
    check_compatible(spec().to_dict(), spec(dtype="bf16"))
    check_compatible(spec(), json.loads(json.dumps(spec().to_dict())))


@pytest.mark.parametrize(
    ("field", "value"),
    [("dtype", "float16"), ("num_layers", 36), ("num_kv_heads", 4), ("head_size", 64), ("block_size", 32)],
)  # fmt: skip
def test_check_compatible_names_the_differing_field(field: str, value: object) -> None:
    src = spec()
    dst = spec(**{field: value})
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(src, dst.to_dict())
    err = info.value
    assert err.field == field
    assert err.src_value == getattr(src, field) and err.dst_value == value
    assert err.mismatches == ((field, getattr(src, field), value),)
    assert field in str(err) and isinstance(err, ValueError)


def test_block_layout_is_local_to_each_replica() -> None:
    # gather_blocks fills an NHD buffer from either order and scatter_blocks writes the destination's own.
    check_compatible(spec(block_layout="NHD"), spec(block_layout="HND").to_dict())
    assert spec(block_layout="HND").buffer_shape(3) == spec().buffer_shape(3)


def test_an_opaque_block_layout_meets_only_its_own() -> None:
    # vLLM's CPU blocks are raw bytes to us: never scattered into an NHD/HND cache, nor the other way round.
    check_compatible(spec(block_layout="opaque"), spec(block_layout="opaque").to_dict())
    for other in ("NHD", "HND"):
        for src, dst in ((other, "opaque"), ("opaque", other)):
            with pytest.raises(LayoutMismatch) as info:
                check_compatible(spec(block_layout=src), spec(block_layout=dst))
            assert info.value.mismatches == (("block_layout", src, dst),)


def test_check_compatible_reports_every_difference() -> None:
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(spec(), spec(dtype="float16", block_size=32, num_layers=2))
    assert info.value.field == "dtype"
    assert [m[0] for m in info.value.mismatches] == ["dtype", "num_layers", "block_size"]


def test_check_compatible_rejects_malformed_peer_dict() -> None:
    with pytest.raises(LayoutError, match="missing") as info:
        check_compatible(spec(), {"version": 2, "dtype": "bfloat16"})
    assert not isinstance(info.value, LayoutMismatch)


def test_describe_numpy_caches_nhd_and_hnd() -> None:
    nhd = [np.zeros((2, 10, 16, 4, 64), dtype=np.float16) for _ in range(3)]
    described = KVCacheSpec.describe(nhd)
    assert described == KVCacheSpec(3, 16, 4, 64, "float16", "NHD")
    assert described.layer_shape(10) == nhd[0].shape
    raw = describe_kv_cache(nhd)
    assert KVCacheSpec.from_kv_cache_layout(raw) == described
    # One half-layer block of blocks.KVCacheLayout is bytes_per_block / (2 * num_layers).
    assert raw.block_nbytes * 2 * raw.num_layers == described.bytes_per_block
    assert raw.transfer_nbytes(7) == described.transfer_nbytes(7)
    assert raw.buffer_shape(7) == described.buffer_shape(7)


def test_describe_hnd_cache_through_its_logical_view() -> None:
    expected = KVCacheSpec(3, 16, 4, 64, "float32", "HND")
    hnd = [np.zeros(expected.layer_shape(10), dtype=np.float32) for _ in range(3)]
    assert hnd[0].shape == (2, 10, 4, 16, 64)
    logical = [layer.transpose(0, 1, 3, 2, 4) for layer in hnd]  # [2, num_blocks, block_size, heads, head_size]
    assert KVCacheSpec.describe(logical) == expected


def test_describe_rejects_other_strides() -> None:
    padded = np.zeros((2, 10, 16, 4, 128), dtype=np.float16)
    strided = [padded[..., :64]]  # each head padded to 128 elements: neither NHD nor HND
    layout = describe_kv_cache(strided)
    assert layout.kv_layout not in ("NHD", "HND")
    with pytest.raises(LayoutError, match="neither NHD nor HND"):
        KVCacheSpec.from_kv_cache_layout(layout)


def test_describe_reference_engine_cache() -> None:
    pytest.importorskip("torch")
    from psrl.engine.config import ModelConfig
    from psrl.engine.kv_cache import CacheConfig, PagedKVCache

    config = ModelConfig(num_hidden_layers=3, num_key_value_heads=2, head_dim=32, torch_dtype="float32")
    cache = PagedKVCache(config, CacheConfig(block_size=8, num_blocks=5))
    described = KVCacheSpec.describe(cache.layers)
    expected = KVCacheSpec.for_engine(
        "reference", num_layers=3, block_size=8, num_kv_heads=2, head_size=32, dtype=config.dtype
    )
    assert described == expected
    check_compatible(described, expected.to_dict())

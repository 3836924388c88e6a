"""LMCache-compatible chunk keys: chained prefix hashes over fixed-size token chunks.

Reimplements the key scheme of LMCache 0.5.x (``lmcache/v1/token_database.py`` ``ChunkedTokenDatabase``
and ``lmcache/utils.py`` ``CacheEngineKey``) without importing LMCache, vLLM or torch, so a replica can
name the chunks of a request the way an LMCache store does:

* tokens are cut into chunks of ``chunk_size`` tokens (LMCache default 256); the last partial chunk gets
  a key only with ``save_unfull_chunk`` (LMCache's engine config defaults it to False; a bare
  ``ChunkedTokenDatabase()`` built without a config uses True);
* chunk ``i`` is named by ``h_i = H((h_{i-1}, tuple(chunk_i), ()))`` with ``h_{-1} = NONE_HASH``, where
  the empty tuple is LMCache's canonicalized (absent) ``extra_keys``;
* ``H`` is Python's ``hash()`` (``"builtin"``, LMCache's default ``pre_caching_hash_algorithm``) or
  vLLM's ``sha256_cbor`` (SHA-256 of the canonical CBOR encoding), whose 32-byte digest LMCache folds to
  an int as its first 8 bytes, big-endian. LMCache takes ``sha256_cbor`` from vLLM: when vLLM is not
  importable next to LMCache, it falls back to ``hash()`` whatever the config says, so pass the
  algorithm LMCache actually ends up using;
* ``NONE_HASH`` is 0 unless vLLM is importable, in which case LMCache takes vLLM's ``init_none_hash``
  value, ``H(PYTHONHASHSEED)`` (random per process when PYTHONHASHSEED is unset): see ``none_hash``.

``builtin`` hashes of int tuples do not depend on PYTHONHASHSEED (only str/bytes hashing is salted), so
with ``NONE_HASH = 0`` they agree across processes of one CPython build (64-bit, 3.8+ tuple hash); the
seed only enters through a vLLM-derived ``NONE_HASH``, which hashes the seed string.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "HASH_ALGORITHMS",
    "NONE_HASH",
    "CacheEngineKey",
    "ChunkKeyError",
    "HashAlgorithm",
    "canonical_cbor",
    "chunk_hashes",
    "chunk_keys",
    "chunk_ranges",
    "hash_chunk",
    "lmcache_dtype",
    "none_hash",
]

HashAlgorithm = Literal["builtin", "sha256_cbor"]
HASH_ALGORITHMS: tuple[str, ...] = get_args(HashAlgorithm)
DEFAULT_CHUNK_SIZE = 256
NONE_HASH = 0  # LMCache's chain seed when vLLM is not importable (or predates init_none_hash)

TokenIds = Sequence[int] | Any  # a sequence of ints, or a numpy array / torch tensor (anything with tolist())


class ChunkKeyError(ValueError):
    """Bad arguments for chunk keys (chunk size, algorithm, dtype, key string)."""


# ---- canonical CBOR (the subset the chunk hashes need) -------------------------------------------------


def _cbor_head(major: int, value: int, out: bytearray) -> None:
    if value < 24:
        out.append(major << 5 | value)
    elif value < 1 << 8:
        out += bytes((major << 5 | 24, value))
    elif value < 1 << 16:
        out.append(major << 5 | 25)
        out += value.to_bytes(2, "big")
    elif value < 1 << 32:
        out.append(major << 5 | 26)
        out += value.to_bytes(4, "big")
    else:
        out.append(major << 5 | 27)
        out += value.to_bytes(8, "big")


def _cbor_encode(obj: object, out: bytearray) -> None:
    if isinstance(obj, bool) or obj is None:
        raise TypeError(f"canonical_cbor: {type(obj).__name__} is not supported")
    if isinstance(obj, int):
        major, value = (0, obj) if obj >= 0 else (1, -1 - obj)
        if value < 1 << 64:
            _cbor_head(major, value, out)
        else:  # bignum: tag 2 (positive) or 3 (negative) over the minimal big-endian bytes
            _cbor_head(6, 2 + major, out)
            raw = value.to_bytes((value.bit_length() + 7) // 8, "big")
            _cbor_head(2, len(raw), out)
            out += raw
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        _cbor_head(3, len(raw), out)
        out += raw
    elif isinstance(obj, bytes | bytearray):
        _cbor_head(2, len(obj), out)
        out += obj
    elif isinstance(obj, tuple | list):
        _cbor_head(4, len(obj), out)
        for item in obj:
            _cbor_encode(item, out)
    else:
        raise TypeError(f"canonical_cbor: {type(obj).__name__} is not supported")


def canonical_cbor(obj: object) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic encoding) of ints, str, bytes and tuples/lists.

    Byte-identical to ``cbor2.dumps(obj, canonical=True)`` for these types, which is what vLLM's
    ``sha256_cbor`` hashes; tuples and lists both encode as arrays.
    """
    out = bytearray()
    _cbor_encode(obj, out)
    return bytes(out)


# ---- hashing -------------------------------------------------------------------------------------------


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in HASH_ALGORITHMS:
        raise ChunkKeyError(f"unknown hash algorithm {algorithm!r}; expected one of {list(HASH_ALGORITHMS)}")


def _sha256_cbor_int(obj: object) -> int:
    # vLLM's sha256_cbor returns the 32-byte digest; LMCache keeps its first 8 bytes as a big-endian int.
    return int.from_bytes(hashlib.sha256(canonical_cbor(obj)).digest()[:8], "big")


def _hash(algorithm: str, obj: object) -> int:
    if algorithm == "builtin":
        return hash(obj)
    return _sha256_cbor_int(obj)


def hash_chunk(prefix_hash: int, chunk: Sequence[int], *, algorithm: HashAlgorithm = "builtin") -> int:
    """The hash of one chunk chained on ``prefix_hash``: ``H((prefix_hash, tuple(chunk), ()))``."""
    _check_algorithm(algorithm)
    return _hash(algorithm, (int(prefix_hash), tuple(int(t) for t in chunk), ()))


def none_hash(algorithm: HashAlgorithm = "builtin", *, vllm_seed: str | None = None) -> int:
    """The chain seed LMCache 0.5.x starts from.

    ``vllm_seed=None``: 0, LMCache's value when vLLM is not importable. Otherwise the value LMCache takes
    from vLLM's ``init_none_hash`` when PYTHONHASHSEED is ``vllm_seed``: ``H(vllm_seed)``. For
    ``builtin`` that is ``hash(vllm_seed)``, a str hash salted by the seed, so it can only be computed in a
    process that runs with ``PYTHONHASHSEED=vllm_seed``; anything else raises ChunkKeyError.
    """
    _check_algorithm(algorithm)
    if vllm_seed is None:
        return NONE_HASH
    if algorithm == "sha256_cbor":
        return _sha256_cbor_int(vllm_seed)
    running_seed = os.environ.get("PYTHONHASHSEED")
    if running_seed != vllm_seed:
        raise ChunkKeyError(
            f"builtin NONE_HASH for PYTHONHASHSEED={vllm_seed!r} is hash({vllm_seed!r}), which only a process "
            f"started with that PYTHONHASHSEED can compute (this one has {running_seed!r})"
        )
    return hash(vllm_seed)


def chunk_ranges(
    num_tokens: int, *, chunk_size: int = DEFAULT_CHUNK_SIZE, save_unfull_chunk: bool = False
) -> list[tuple[int, int]]:
    """``(start, end)`` token ranges of the chunks that get keys, in order."""
    _check_chunk_size(chunk_size)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ChunkKeyError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
    end = num_tokens if save_unfull_chunk else num_tokens - num_tokens % chunk_size
    return [(start, min(start + chunk_size, num_tokens)) for start in range(0, end, chunk_size)]


def _check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ChunkKeyError(f"chunk_size must be a positive integer, got {chunk_size!r}")


def _token_list(token_ids: TokenIds) -> list[int]:
    if hasattr(token_ids, "tolist"):  # numpy array or torch tensor
        token_ids = token_ids.tolist()
    return [int(t) for t in token_ids]


def chunk_hashes(
    token_ids: TokenIds,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    algorithm: HashAlgorithm = "builtin",
    save_unfull_chunk: bool = False,
    initial_hash: int = NONE_HASH,
) -> list[int]:
    """Chained prefix hashes of the chunks of ``token_ids``, one per ``chunk_ranges`` entry.

    Equal to LMCache 0.5.x ``ChunkedTokenDatabase.process_tokens(tokens, make_key=False)`` hashes for the
    same chunk size, ``save_unfull_chunk``, effective hash algorithm and ``NONE_HASH`` (``initial_hash``).
    """
    _check_algorithm(algorithm)
    tokens = _token_list(token_ids)
    hashes: list[int] = []
    prefix = int(initial_hash)
    for start, end in chunk_ranges(len(tokens), chunk_size=chunk_size, save_unfull_chunk=save_unfull_chunk):
        prefix = _hash(algorithm, (prefix, tuple(tokens[start:end]), ()))
        hashes.append(prefix)
    return hashes


# ---- CacheEngineKey ------------------------------------------------------------------------------------

# dtype names as LMCache writes them in keys (lmcache/utils.py TORCH_DTYPE_TO_STR_DTYPE), from torch/numpy names.
_LMCACHE_DTYPES: dict[str, str] = {
    "float16": "half",
    "half": "half",
    "bfloat16": "bfloat16",
    "float32": "float",
    "float": "float",
    "float64": "double",
    "double": "double",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "bool": "bool",
    "float8_e4m3fn": "fp8_e4m3fn",
    "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "float8_e5m2": "fp8_e5m2",
    "float8_e5m2fnuz": "fp8_e5m2fnuz",
    "fp8_e4m3fn": "fp8_e4m3fn",
    "fp8_e4m3fnuz": "fp8_e4m3fnuz",
    "fp8_e5m2": "fp8_e5m2",
    "fp8_e5m2fnuz": "fp8_e5m2fnuz",
}


def lmcache_dtype(dtype: object) -> str:
    """LMCache's key name for a dtype: "float16"/"half"/torch.float16 -> "half", float32 -> "float", ..."""
    name = str(dtype).removeprefix("torch.")
    try:
        return _LMCACHE_DTYPES[name]
    except KeyError:
        raise ChunkKeyError(f"dtype {dtype!r} has no LMCache key name") from None


@dataclass(frozen=True)
class CacheEngineKey:
    """LMCache 0.5.x ``CacheEngineKey`` (``layer_id`` set: ``LayerCacheEngineKey``) as plain data.

    ``to_string()``: ``model_name@world_size@worker_id@<chunk_hash hex>@dtype[@layer_id][@tag%value...]``,
    the hash as Python's ``f"{h:x}"`` (a negative builtin hash keeps its minus sign). ``dtype`` is stored
    as LMCache's name ("half", "bfloat16", "float", ...); torch/numpy names are converted. LMCache 0.5.x
    keys carry no ``fmt`` field (older LMCache put the serving-engine format first). For MLA with
    ``save_only_first_rank`` LMCache writes world_size 1: pass that here.
    """

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: str
    tags: tuple[tuple[str, str], ...] = field(default=())
    layer_id: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", lmcache_dtype(self.dtype))
        object.__setattr__(self, "tags", tuple((str(k), str(v)) for k, v in self.tags))

    @property
    def chunk_hash_hex(self) -> str:
        return f"{self.chunk_hash:x}"

    def to_string(self) -> str:
        parts = [self.model_name, str(self.world_size), str(self.worker_id), self.chunk_hash_hex, self.dtype]
        if self.layer_id is not None:
            parts.append(str(self.layer_id))
        parts.extend(f"{k}%{v}" for k, v in self.tags)
        return "@".join(parts)

    @classmethod
    def from_string(cls, s: str) -> CacheEngineKey:
        """Parse ``to_string()`` output (a sixth all-digit part is a layer id, as LMCache's parse_cache_key)."""
        parts = s.strip().split("@")
        if len(parts) < 5:
            raise ChunkKeyError(f"invalid cache engine key {s!r}: expected at least 5 '@'-separated parts")
        rest = parts[5:]
        layer_id = None
        if rest and rest[0].isdigit():
            layer_id = int(rest.pop(0))
        tags = []
        for tag in rest:
            key, sep, value = tag.partition("%")
            if not sep:
                raise ChunkKeyError(f"invalid cache engine key {s!r}: tag {tag!r} is not key%value")
            tags.append((key, value))
        try:
            return cls(
                model_name=parts[0],
                world_size=int(parts[1]),
                worker_id=int(parts[2]),
                chunk_hash=int(parts[3], 16),
                dtype=parts[4],
                tags=tuple(tags),
                layer_id=layer_id,
            )
        except ValueError as exc:
            raise ChunkKeyError(f"invalid cache engine key {s!r}: {exc}") from None

    def split_layers(self, num_layers: int) -> list[CacheEngineKey]:
        """Per-layer keys, as LMCache's ``split_layers``."""
        return [
            CacheEngineKey(self.model_name, self.world_size, self.worker_id, self.chunk_hash, self.dtype, self.tags, i)
            for i in range(num_layers)
        ]


def chunk_keys(
    token_ids: TokenIds,
    *,
    model_name: str,
    world_size: int,
    worker_id: int,
    dtype: object,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    algorithm: HashAlgorithm = "builtin",
    save_unfull_chunk: bool = False,
    initial_hash: int = NONE_HASH,
    tags: Iterable[tuple[str, object]] = (),
) -> list[tuple[int, int, CacheEngineKey]]:
    """``(start, end, key)`` per chunk, as LMCache's ``process_tokens(tokens)`` yields them.

    ``tags`` are LMCache's request tags (``request_configs`` entries ``lmcache.tag.<key>``), in order.
    """
    tokens = _token_list(token_ids)
    ranges = chunk_ranges(len(tokens), chunk_size=chunk_size, save_unfull_chunk=save_unfull_chunk)
    hashes = chunk_hashes(
        tokens,
        chunk_size=chunk_size,
        algorithm=algorithm,
        save_unfull_chunk=save_unfull_chunk,
        initial_hash=initial_hash,
    )
    key_tags = tuple((str(k), str(v)) for k, v in tags)
    lm_dtype = lmcache_dtype(dtype)
    return [
        (start, end, CacheEngineKey(model_name, world_size, worker_id, h, lm_dtype, key_tags))
        for (start, end), h in zip(ranges, hashes, strict=True)
    ]

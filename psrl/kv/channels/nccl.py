"""NCCL send/recv between nodes: :class:`NcclChannel`.

NCCL is loaded at run time (``nvidia-nccl-cu*`` wheel or the loader path); nothing needs it to build or import.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from psrl import _kvx
from psrl.kv.blocks import BlockIds, _as_block_ids, _new_buffer, _scatter, describe_kv_cache, gather_blocks
from psrl.kv.channels.base import require_cuda, torch_stream

if TYPE_CHECKING:
    import torch

__all__ = ["NcclChannel", "NcclUnavailableError", "nccl_get_unique_id", "nccl_library_candidates"]

NcclUnavailableError = _kvx.NcclUnavailableError


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
        require_cuda("the NCCL channel")
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
        self._comm.send(ptr, nbytes, peer, torch_stream(self.device, stream))

    def recv(self, ptr: int, nbytes: int, peer: int, stream: int | None = None) -> None:
        self._comm.recv(ptr, nbytes, peer, torch_stream(self.device, stream))

    def send_tensor(self, tensor: torch.Tensor, peer: int, stream: int | None = None) -> None:
        self.send(int(tensor.data_ptr()), _contiguous_cuda_nbytes(tensor), peer, stream)

    def recv_tensor(self, tensor: torch.Tensor, peer: int, stream: int | None = None) -> None:
        self.recv(int(tensor.data_ptr()), _contiguous_cuda_nbytes(tensor), peer, stream)

    def send_blocks(
        self,
        layer_caches: Sequence[torch.Tensor],
        block_ids: BlockIds,
        peer: int,
        *,
        num_tokens: int | None = None,
        stream: int | None = None,
    ) -> torch.Tensor:
        """Gather ``block_ids`` of CUDA caches into a new buffer and send it, both on ``stream``. Returns the
        buffer: keep it alive until the stream has passed the send (or use torch's current stream)."""
        cuda_stream = torch_stream(self.device, stream)
        buffer = gather_blocks(layer_caches, block_ids, stream=cuda_stream, num_tokens=num_tokens)
        self.send_tensor(buffer, peer, cuda_stream)
        return buffer

    def recv_blocks(
        self,
        layer_caches: Sequence[torch.Tensor],
        block_ids: BlockIds,
        peer: int,
        *,
        num_tokens: int | None = None,
        stream: int | None = None,
    ) -> torch.Tensor:
        """Receive a buffer from ``peer`` and scatter it into ``block_ids`` of CUDA caches, both on
        ``stream``; returns the buffer (same lifetime rule as :meth:`send_blocks`)."""
        layout = describe_kv_cache(layer_caches)
        ids = _as_block_ids(block_ids)
        cuda_stream = torch_stream(self.device, stream)
        buffer = cast("torch.Tensor", _new_buffer(layer_caches[0], layout.buffer_shape(len(ids))))
        self.recv_tensor(buffer, peer, cuda_stream)
        _scatter(layout, buffer, layer_caches, ids, None, cuda_stream, num_tokens)  # the caches are described
        return buffer

    def close(self, *, abort: bool = False) -> None:
        self._comm.destroy(abort)

    def __enter__(self) -> NcclChannel:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(abort=exc_type is not None)


def _contiguous_cuda_nbytes(tensor: torch.Tensor) -> int:
    if not getattr(tensor, "is_cuda", False) or not tensor.is_contiguous():
        raise ValueError("NCCL sends and receives contiguous CUDA tensors only")
    return int(tensor.numel()) * int(tensor.element_size())

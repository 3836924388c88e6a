"""What the KV channels share: their error base class and the CUDA stream they enqueue on."""

from __future__ import annotations

import sys

from psrl.kv.blocks import HAS_CUDA

__all__ = ["CudaUnavailableError", "KVChannelError", "require_cuda", "torch_stream"]


class KVChannelError(Exception):
    """Base class of the errors a KV channel raises on its own."""


class CudaUnavailableError(KVChannelError, RuntimeError):
    """psrl._kvx was built without CUDA, so CUDA IPC and NCCL channels are not available."""


def require_cuda(what: str) -> None:
    if not HAS_CUDA:
        raise CudaUnavailableError(
            f"{what} needs psrl._kvx built with CUDA; this build has none (nvcc was not found when it was built)"
        )


def torch_stream(device: int, stream: int | None) -> int:
    """``stream`` or torch's current stream on ``device`` (the legacy default stream without torch)."""
    if stream is not None:
        return int(stream)
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    return int(torch.cuda.current_stream(device).cuda_stream)

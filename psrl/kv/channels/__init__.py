"""Channels that move gathered KV blocks between replicas, one module per transport.

All three carry one buffer layout (``[num_layers, 2, num_ids, block_size, num_kv_heads, head_size]``, see
``psrl.kv.blocks``), so the two sides may use different cache strides (NHD/HND) or block numbering:

* :mod:`.shm`: POSIX shared memory between processes on one host (:class:`ShmChannel`, its pool and mappings);
* :mod:`.cuda_ipc`: CUDA IPC between processes on one node (:class:`CudaIpcExport` / :class:`CudaIpcBuffer`);
* :mod:`.nccl`: NCCL send/recv between nodes (:class:`NcclChannel`).

:mod:`.base` holds what they share (:class:`KVChannelError`, the CUDA stream choice).
"""

from psrl.kv.blocks import KVLayoutMismatchError
from psrl.kv.channels.base import CudaUnavailableError, KVChannelError
from psrl.kv.channels.cuda_ipc import (
    CudaEvent,
    CudaIpcBuffer,
    CudaIpcDescriptor,
    CudaIpcExport,
    DeviceArray,
    cuda_peer_copy_async,
)
from psrl.kv.channels.nccl import NcclChannel, NcclUnavailableError, nccl_get_unique_id, nccl_library_candidates
from psrl.kv.channels.shm import (
    ShmChannel,
    ShmMappings,
    ShmPool,
    ShmSegment,
    ShmSegmentNotFoundError,
    ShmSizeMismatchError,
    ShmTransfer,
    new_segment_name,
    shm_receive,
    shm_send,
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

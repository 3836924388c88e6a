"""Where a replica's KV cache lives, and which channel moves KV between two replicas (pure: no gRPC, no torch).

An end of a transfer is a node and a device kind (`KvEnd`). A node is one machine as far as memory goes: two
replicas on one node can share POSIX shared memory and, with GPUs, CUDA IPC handles; two on different nodes
meet only over the network. `joining_channels` lists the channels that join two ends, best first, and `choose_channel`
takes the best one a replica serves:

| the two ends | channels, best first |
|---|---|
| one node, both CPU | `shm` |
| one node, both CUDA | `cuda_ipc`, then `shm` (staged through host memory) |
| one node, one CPU and one CUDA | `shm`: host memory is what both reach; the CUDA end stages through it |
| two nodes, both CUDA | `nccl` |
| two nodes, a CPU end | none: CPU KV does not cross hosts, the destination recomputes |

A CUDA replica reads and writes host memory anyway (the vLLM connector's pins are host copies, and it copies a
segment to its device), so `shm` joins any two ends of one node; neither GPU channel can serve a CPU end.
"""

from __future__ import annotations

import enum
import os
import socket
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NODE_ID_ENV",
    "DeviceKind",
    "KvChannel",
    "KvEnd",
    "choose_channel",
    "device_kind",
    "joining_channels",
    "local_node_id",
]

NODE_ID_ENV = "PSRL_NODE_ID"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class DeviceKind(enum.StrEnum):
    """Where a KV cache's blocks are (the values are the wire form: TransferKvRequest.device)."""

    CPU = "cpu"  # host memory
    CUDA = "cuda"


class KvChannel(enum.StrEnum):
    """A transport for gathered KV blocks (psrl.kv.channels; the values are the wire form:
    TransferKvRequest.channel)."""

    SHM = "shm"  # POSIX shared memory, one host
    CUDA_IPC = "cuda_ipc"  # CUDA IPC memory handles, one node
    NCCL = "nccl"  # NCCL send/recv, across nodes


@dataclass(frozen=True)
class KvEnd:
    """One end of a transfer: the node a replica runs on and the device its KV cache is on."""

    node_id: str
    device: DeviceKind


def joining_channels(source: KvEnd, destination: KvEnd) -> tuple[KvChannel, ...]:
    """The channels that join two ends, best first (the table in the module docstring); () when none does."""
    both_cuda = source.device is DeviceKind.CUDA and destination.device is DeviceKind.CUDA
    if source.node_id == destination.node_id:
        return (KvChannel.CUDA_IPC, KvChannel.SHM) if both_cuda else (KvChannel.SHM,)
    return (KvChannel.NCCL,) if both_cuda else ()


def choose_channel(
    source: KvEnd, destination: KvEnd, served: Collection[KvChannel] = tuple(KvChannel)
) -> KvChannel | None:
    """The best channel between two ends among those `served`; None when no served one joins them."""
    return next((c for c in joining_channels(source, destination) if c in served), None)


def device_kind(cache: object) -> DeviceKind:
    """The device kind of a KV cache tensor (torch or numpy): CUDA for a CUDA tensor, else host memory."""
    return DeviceKind.CUDA if getattr(cache, "is_cuda", False) else DeviceKind.CPU


def local_node_id() -> str:
    """This machine's node id: `$PSRL_NODE_ID` if set, else `<hostname>-<boot id>`.

    The host name tells containers apart (each has its own, so two containers on one host, which do not share
    `/dev/shm` by default, are two nodes), and the kernel's boot id (`/proc/sys/kernel/random/boot_id`, one
    per boot of a machine, shared by its containers) tells apart hosts that share a name (`localhost`, one
    image's fixed name). Both hold for the life of every process on the host, so all replicas there agree.
    Where that is not the sharing that matters (containers given one `/dev/shm`, hosts under a cluster
    manager's own ids), set `$PSRL_NODE_ID` or pass `--node-id` (a Ray launcher passes Ray's node id).
    """
    given = os.environ.get(NODE_ID_ENV, "").strip()
    if given:
        return given
    try:
        boot_id = _BOOT_ID.read_text().strip()
    except OSError:  # not Linux: the host name alone
        return socket.gethostname()
    return f"{socket.gethostname()}-{boot_id}"

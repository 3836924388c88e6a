"""The channel between two replicas from their node ids and devices, and this machine's default node id."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from psrl.kv import placement
from psrl.kv.placement import (
    NODE_ID_ENV,
    DeviceKind,
    KvChannel,
    KvEnd,
    choose_channel,
    device_kind,
    joining_channels,
    local_node_id,
)

CPU, CUDA = DeviceKind.CPU, DeviceKind.CUDA


@pytest.mark.parametrize(
    ("source", "destination", "joining"),
    [
        (KvEnd("a", CPU), KvEnd("a", CPU), (KvChannel.SHM,)),
        (KvEnd("a", CUDA), KvEnd("a", CUDA), (KvChannel.CUDA_IPC, KvChannel.SHM)),
        (KvEnd("a", CPU), KvEnd("a", CUDA), (KvChannel.SHM,)),  # host memory is what both reach
        (KvEnd("a", CUDA), KvEnd("a", CPU), (KvChannel.SHM,)),
        (KvEnd("a", CUDA), KvEnd("b", CUDA), (KvChannel.NCCL,)),
        (KvEnd("a", CPU), KvEnd("b", CPU), ()),  # CPU KV does not cross hosts
        (KvEnd("a", CPU), KvEnd("b", CUDA), ()),
        (KvEnd("a", CUDA), KvEnd("b", CPU), ()),
    ],
)
def test_the_channels_follow_the_two_ends(source: KvEnd, destination: KvEnd, joining: tuple[KvChannel, ...]) -> None:
    assert joining_channels(source, destination) == joining
    assert choose_channel(source, destination) == (joining[0] if joining else None)
    # A replica that serves only shared memory uses it wherever it joins the two ends.
    assert choose_channel(source, destination, {KvChannel.SHM}) == (KvChannel.SHM if KvChannel.SHM in joining else None)


def test_channel_and_device_names_are_their_wire_values() -> None:
    assert [c.value for c in KvChannel] == ["shm", "cuda_ipc", "nccl"]
    assert DeviceKind("cuda") is CUDA and DeviceKind("cpu") is CPU
    with pytest.raises(ValueError):
        DeviceKind("mps")


def test_a_host_array_is_on_the_cpu_and_a_cuda_tensor_on_cuda() -> None:
    class CudaTensor:
        is_cuda = True

    assert device_kind(np.zeros(2)) is CPU and device_kind(CudaTensor()) is CUDA


def test_the_node_id_is_the_environment_s_else_the_host_name_and_boot_id(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv(NODE_ID_ENV, "ray-node-7")
    assert local_node_id() == "ray-node-7"
    monkeypatch.setenv(NODE_ID_ENV, "  ")  # blank: not set
    boot_id = tmp_path / "boot_id"
    boot_id.write_text("0f1e2d3c-aaaa-bbbb-cccc-0123456789ab\n")
    monkeypatch.setattr(placement, "_BOOT_ID", boot_id)
    assert local_node_id() == f"{socket.gethostname()}-0f1e2d3c-aaaa-bbbb-cccc-0123456789ab"
    assert local_node_id() == local_node_id()  # stable: every replica of this host agrees
    monkeypatch.setattr(placement, "_BOOT_ID", tmp_path / "missing")  # not Linux
    assert local_node_id() == socket.gethostname()

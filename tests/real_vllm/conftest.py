"""Real vLLM replicas (CPU build), shared by the whole stage: each takes ~35 s to start on this machine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _procs import Proc
from _vllm import HAS_VLLM, start_stock_vllm, start_vllm_replica

from psrl.gateway.processes import stop_processes
from psrl.worker.model_folder import build_weighted_model_folder


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/real_vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)
            if not HAS_VLLM:
                item.add_marker(pytest.mark.skip(reason="vllm and smg-grpc-servicer are not installed"))


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_weighted_model_folder(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="session")
def stock_vllm(vllm_model_dir: Path, log_dir: Path) -> Iterator[Proc]:
    """One stock vLLM gRPC replica (vLLM's launcher + smg-grpc-servicer) for the whole session."""
    proc = start_stock_vllm(vllm_model_dir, log_dir)
    yield proc
    stop_processes([proc.proc])


@pytest.fixture(scope="session")
def vllm_pair(vllm_model_dir: Path, log_dir: Path) -> Iterator[list[Proc]]:
    """Two replicas of ours (`python -m psrl.worker --engine vllm`), same weights, for the whole session."""
    procs: list[Proc] = []
    try:
        procs += [start_vllm_replica(vllm_model_dir, log_dir), start_vllm_replica(vllm_model_dir, log_dir)]
        yield procs
    finally:
        stop_processes([p.proc for p in procs])

"""Shared fixtures: the tiny model folder, and real replica/router processes on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _procs import Proc, start_replica, start_router

from psrl.gateway.processes import stop_processes
from psrl.tokenizer import Tokenizer
from psrl.worker.model_folder import build_tiny_model_folder


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_folder(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(model_dir)


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def replica(model_dir: Path, log_dir: Path) -> Iterator[Proc]:
    """One dp_size 2 replica shared by a test module."""
    proc = start_replica(model_dir, log_dir, dp_size=2)
    yield proc
    stop_processes([proc.proc])


@pytest.fixture(scope="module")
def router(replica: Proc, log_dir: Path) -> Iterator[Proc]:
    proc = start_router(log_dir, [replica.url])
    yield proc
    stop_processes([proc.proc])

"""Shared fixtures: the tiny model folder, and real replica/router processes on loopback. Tests that start real
processes are marked `procs` (`-m 'not procs'` runs the pure ones alone)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _procs import STARTED, Proc, start_replica, start_router

from psrl.gateway.processes import stop_processes
from psrl.tokenizer import Tokenizer
from psrl.worker.model_folder import build_tiny_model_folder

# Names a test module or fixture uses to start a real process: our starters, and the modules that spawn one.
PROCESS_STARTERS = frozenset(
    {
        "start_replica",
        "start_named_replicas",
        "start_router",
        "start_psmanager",
        "start_session_router",
        "start_stock_vllm",
        "start_vllm_replica",
        "spawn_module",
        "subprocess",
        "multiprocessing",
    }
)


def _starts_processes(item: pytest.Item) -> bool:
    """Whether the test's module holds a process starter, or one of its fixtures calls one."""
    module = getattr(item, "module", None)
    if module is not None and PROCESS_STARTERS & vars(module).keys():
        return True
    fixtures = getattr(item, "_fixtureinfo", None)
    defs = fixtures.name2fixturedefs.values() if fixtures is not None else ()
    return any(PROCESS_STARTERS & set(d.func.__code__.co_names) for ds in defs for d in ds)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.procs)


@pytest.fixture(scope="session", autouse=True)
def _no_process_outlives_the_session() -> Iterator[None]:
    """Stop whatever a test helper started and is still running at the end: a fixture that fails halfway (e.g.
    its router does not start) would otherwise leave the replicas it had started running."""
    yield
    stop_processes([p for p in STARTED if p.poll() is None])


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

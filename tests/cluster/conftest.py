"""One local Ray cluster for the tests of psrl.gateway.ray: no dashboard, 8 logical CPUs (actors reserve them;
the processes share the machine's real cores), this node's own address (Ray never uses loopback for a node)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A running Ray cluster, and a folder for its tests' logs and caches."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=8, include_dashboard=False, namespace="psrl-tests", log_to_driver=False)
    try:
        yield tmp_path_factory.mktemp("ray")
    finally:
        ray.shutdown()

"""What a loop-back tells its new instance about its KV (kv_transfer_params_json), and the config's checks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from psrl.router.config import KvTransferConfig
from psrl.router.dispatch import Dispatcher
from psrl.router.pipeline.context import GenerationInput, SamplingSpec
from psrl.router.pipeline.execute import _moved_tokens
from psrl.router.registry import InstanceId, WorkerRegistry

GEN = GenerationInput("req-r1", [5, 6, 7, 8], SamplingSpec())


def _dispatcher(registry: WorkerRegistry, **config: Any) -> Dispatcher:
    none: Any = None
    return Dispatcher(
        registry,
        none,
        none,
        None,
        none,
        none,
        none,
        request_timeout_s=None,
        partial_rollout=True,
        max_iterations=4,
        kv_transfer=KvTransferConfig(**config),
    )


def test_params_name_the_source_and_the_tokens_to_move() -> None:
    registry = WorkerRegistry()
    registry.create_worker("w0", "grpc://10.0.0.1:7000", models=["m"], labels={}, dp_size=2)
    registry.create_worker("h0", "http://10.0.0.2:8000", models=["m"], labels={}, connection_mode="http")
    d = _dispatcher(registry, enable=True, transfer_mode="pin_sync", transfer_timeout_ms=700)
    params = json.loads(d.kv_transfer_params((InstanceId("w0", 1), "req"), GEN))
    assert params == {
        "source": {"target": "10.0.0.1:7000", "dp_rank": 1, "base_worker_id": "w0"},
        "request_id": "req",
        "num_tokens": 3,  # all but the last prompt token, which the destination computes
        "mode": "pin_sync",
        "timeout_ms": 700,
    }
    assert d.kv_transfer_params(None, GEN) == ""  # the first iteration: no KV anywhere yet
    assert d.kv_transfer_params((InstanceId("gone", 0), "req"), GEN) == ""  # source deregistered
    assert d.kv_transfer_params((InstanceId("h0", 0), "req"), GEN) == ""  # HTTP workers move no KV
    assert _dispatcher(registry).kv_transfer_params((InstanceId("w0", 0), "req"), GEN) == ""  # off by default


@pytest.mark.parametrize(
    ("config", "match"),
    [({"transfer_mode": "eventually"}, "transfer_mode"), ({"transfer_timeout_ms": 0}, "transfer_timeout_ms")],
)
def test_bad_kv_transfer_config(config: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KvTransferConfig(**config).validate()


@pytest.mark.parametrize(
    ("report", "moved"),
    [
        ('{"moved_tokens": 7}', 7),
        ("x", 0),
        ("[]", 0),
        ('{"moved_tokens": null}', 0),
        ('{"moved_tokens": "a"}', 0),
        ("", 0),
    ],
)
def test_an_unreadable_moved_tokens_report_counts_as_recomputed(report: str, moved: int) -> None:
    assert _moved_tokens(report) == moved

"""The committed stubs in psrl/_proto are exactly what proto/gen_stubs.py generates from proto/."""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    generate = runpy.run_path(str(ROOT / "proto" / "gen_stubs.py"))["generate"]
    fresh = generate(tmp_path)
    assert fresh, "no stubs were generated"
    for path in fresh:
        committed = ROOT / "psrl" / "_proto" / path.name
        assert committed.is_file(), f"{path.name} is generated but not committed (run `make proto`)"
        assert committed.read_text() == path.read_text(), f"{path.name} is stale (run `make proto`)"


def test_psmanager_service_imports() -> None:
    from psrl._proto import psrl_manager_pb2, psrl_manager_pb2_grpc

    req = psrl_manager_pb2.CanReserveRequest(request_ids=[1, 2], model_versions=[3])
    assert psrl_manager_pb2.CanReserveRequest.FromString(req.SerializeToString()) == req
    assert hasattr(psrl_manager_pb2_grpc, "PSManagerStateServicer")

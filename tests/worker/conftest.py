"""An in-process reference replica for the worker tests that need to reach inside it (KV migration off, health
states a process would not show)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from psrl.engine import AsyncEngine, CacheConfig, Engine
from psrl.worker.grpc_services import ReplicaHealthServicer, add_health_and_reflection, replica_grpc_server
from psrl.worker.model_folder import load_model_folder
from psrl.worker.servicer import ReferenceServicer


@dataclass
class InProcessReplica:
    target: str
    engines: list[AsyncEngine]
    health: ReplicaHealthServicer


@pytest.fixture
async def inproc_replica(model_dir: Path) -> AsyncIterator[InProcessReplica]:
    """One dp rank, no KvPuller (KV migration off), VllmEngine plus Health and reflection."""
    folder = load_model_folder(model_dir)
    engine = Engine(
        folder.model_config,
        CacheConfig(block_size=16, num_blocks=64),
        eos_token_ids=folder.tokenizer.eos_token_ids,
        tokenizer=folder.tokenizer,
    )
    engines = [AsyncEngine(engine)]
    servicer = ReferenceServicer(engines, folder, "tiny")
    server, target = replica_grpc_server("127.0.0.1", 0)  # the options the replica process serves with
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, servicer.healthy)
    await server.start()
    try:
        yield InProcessReplica(target, engines, health)
    finally:
        await server.stop(None)
        for e in engines:
            e.shutdown()

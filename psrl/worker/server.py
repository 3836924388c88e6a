"""`python -m psrl.worker`: one replica process serving VllmEngine over gRPC.

`--engine reference` (the default) runs our reference engine, described here; `--engine vllm` runs vLLM
behind the stock servicer with the same flags, the same ready line and the same registration
(psrl/worker/vllm_replica.py).

The same gRPC server also serves `psrl.control.ReplicaControl` (proto/psrl/_proto/replica_control.proto,
psrl/worker/control.py), the replica side of a weight sync: PauseGeneration (mode ABORT | WAIT | KEEP,
clear_cache), LoadWeights (version, seed or safetensors path), ResumeGeneration, GetSyncState and FailSync,
each acting on every dp rank at once. While paused or after FailSync, a new Generate gets an empty "abort"
complete frame. Nothing to configure: the service is always registered. So is `psrl.kv.KvMigration`
(proto/psrl/_proto/kv_migration.proto, psrl/worker/kv_migration.py): a sync abort pins each request's KV for
`--kv-pin-ttl-s`, a peer pulls it with TransferKv, and a Generate with `kv_transfer_params_json` pulls its KV
from the source named there before (or, mode async, while) it waits to run; the two replicas' node ids
(`--node-id`) and devices decide whether a channel joins them.

With a token (`--replica-token-file`, else $PSRL_REPLICA_TOKEN) every call to this server but gRPC health and
reflection must carry metadata `authorization: Bearer <token>`, and the replica sends it to its KV peers
(psrl/replica_auth.py); without one the server is open, as on loopback by default.
"""

from __future__ import annotations

import asyncio
import logging

from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from psrl._proto import kv_migration_pb2_grpc, replica_control_pb2_grpc, routed_experts_pb2_grpc
from psrl.engine import AsyncEngine, CacheConfig, Engine
from psrl.worker.config import WorkerArgs, parse_args
from psrl.worker.control import ReplicaControlServicer
from psrl.worker.grpc_services import add_health_and_reflection, replica_grpc_server
from psrl.worker.kv_migration import EngineKvHolder, KvMigrationServicer, KvPuller, KvSourceClient
from psrl.worker.model_folder import build_tiny_model_folder, load_model_folder
from psrl.worker.registration import serve_replica
from psrl.worker.servicer import ReferenceServicer

logger = logging.getLogger("psrl.worker")


async def serve(args: WorkerArgs) -> None:
    import torch

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    folder = load_model_folder(args.model or build_tiny_model_folder())
    served_name = args.served_model_name or folder.path.name
    cache_config = CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks)
    engines = [
        AsyncEngine(
            Engine(
                folder.model_config,
                cache_config,
                seed=args.seed,
                weights_path=str(folder.weights_path) if folder.weights_path else None,
                device=args.device,
                eos_token_ids=folder.tokenizer.eos_token_ids,
                tokenizer=folder.tokenizer,  # stop strings are matched in the decoded output
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=args.enable_prefix_caching,
            )
        )
        for _ in range(args.dp_size)
    ]
    for e in engines:
        e.engine.kv_pin_ttl_s = args.kv_pin_ttl_s or None
    token = args.replica_token()
    server, target = replica_grpc_server(args.host, args.port, token=token)
    node_id = args.node()
    pool_bytes = args.kv_shm_pool_mib << 20
    migration = KvMigrationServicer(EngineKvHolder(engines), node_id=node_id, shm_pool_bytes=pool_bytes)
    client = KvSourceClient(target, node_id=node_id, advertised=args.advertised(target), token=token)
    kv_puller = KvPuller(migration.counters, client, shm_mappings_bytes=pool_bytes)
    servicer = ReferenceServicer(engines, folder, served_name, kv_puller)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
    replica_control_pb2_grpc.add_ReplicaControlServicer_to_server(ReplicaControlServicer(engines), server)
    kv_migration_pb2_grpc.add_KvMigrationServicer_to_server(migration, server)
    routed_experts_pb2_grpc.add_RoutedExpertsServicer_to_server(servicer.routed_experts, server)
    health = add_health_and_reflection(server, servicer.healthy)
    await server.start()
    migration.start()
    failed = await serve_replica(
        args,
        target,
        served_name,
        kv_capacity_tokens=cache_config.num_blocks * cache_config.block_size,
        kv_block_size=cache_config.block_size,
        replica_token=token,
    )
    health.set_not_serving()
    await server.stop(grace=1.0)
    migration.close()
    await kv_puller.close()
    for e in engines:
        e.shutdown()
    if failed:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.engine == "vllm":
        from psrl.worker.vllm_replica import serve_vllm

        asyncio.run(serve_vllm(args))
    else:
        asyncio.run(serve(args))

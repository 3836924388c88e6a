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
from the source named there before (or, mode async, while) it waits to run.

With a token (`--replica-token-file`, else $PSRL_REPLICA_TOKEN) every call to this server but gRPC health and
reflection must carry metadata `authorization: Bearer <token>`, and the replica sends it to its KV peers
(psrl/replica_auth.py); without one the server is open, as on loopback by default.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import dataclass, field

from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from psrl._proto import kv_migration_pb2_grpc, replica_control_pb2_grpc, routed_experts_pb2_grpc
from psrl.engine import AsyncEngine, CacheConfig, Engine
from psrl.replica_auth import ROUTER_API_KEY_ENV, TOKEN_ENV, TOKEN_FILE_FLAG, load_replica_token, load_secret
from psrl.worker.control import ReplicaControlServicer
from psrl.worker.grpc_services import add_health_and_reflection, replica_grpc_server
from psrl.worker.kv_migration import EngineKvHolder, KvMigrationServicer, KvPuller
from psrl.worker.model_folder import build_tiny_model_folder, load_model_folder
from psrl.worker.registration import serve_replica
from psrl.worker.servicer import ReferenceServicer

logger = logging.getLogger("psrl.worker")


ENGINES = ("reference", "vllm")
# Settings of the reference engine that a vLLM replica takes from vLLM's own arguments instead.
REFERENCE_ONLY = (
    "block_size",
    "num_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "device",
    "torch_threads",
)


@dataclass
class WorkerArgs:
    engine: str = "reference"
    host: str = "127.0.0.1"
    port: int = 0
    model: str | None = None
    served_model_name: str | None = None
    dp_size: int = 1
    seed: int = 0
    block_size: int = 16
    num_blocks: int = 1024
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    enable_prefix_caching: bool = True
    device: str = "cpu"
    router: str | None = None
    router_api_key: str | None = None  # prefer router_api_key_file or $PSRL_ROUTER_API_KEY (not in the process list)
    router_api_key_file: str | None = None
    replica_token_file: str | None = None  # else $PSRL_REPLICA_TOKEN; see psrl/replica_auth.py
    worker_id: str | None = None
    torch_threads: int = 0
    kv_pin_ttl_s: float = 30.0
    kv_shm_pool_mib: int = 512
    kv_pin_max_mib: int = 1024  # vLLM replicas: their pins are copies, at most this much of them
    engine_args: list[str] = field(default_factory=list)  # after `--`: vLLM's own engine arguments

    def validate(self) -> None:
        if self.engine_args and self.engine != "vllm":
            raise ValueError("arguments after -- are vLLM engine arguments; they need --engine vllm")
        if self.engine == "vllm":
            defaults = WorkerArgs()
            own = [
                f"--{name.replace('_', '-')}"
                for name in REFERENCE_ONLY
                if getattr(self, name) != getattr(defaults, name)
            ]
            if own:
                raise ValueError(
                    f"{', '.join(own)}: reference-engine settings; with --engine vllm pass vLLM's own engine "
                    "arguments after -- (e.g. -- --block-size 16 --max-num-seqs 64)"
                )
        if self.dp_size < 1:
            raise ValueError("--dp-size must be >= 1")
        if not 0 <= self.port < 65536:
            raise ValueError("--port must be in [0, 65535]")
        if self.kv_pin_ttl_s < 0:
            raise ValueError("--kv-pin-ttl-s must be >= 0")
        if self.kv_shm_pool_mib < 0:
            raise ValueError("--kv-shm-pool-mib must be >= 0")
        if self.kv_pin_max_mib < 0:
            raise ValueError("--kv-pin-max-mib must be >= 0")
        if self.engine != "vllm" and self.kv_pin_max_mib != WorkerArgs.kv_pin_max_mib:
            raise ValueError(
                "--kv-pin-max-mib bounds a vLLM replica's pins (--engine vllm); the reference engine "
                "pins its own blocks"
            )
        if self.router_api_key and self.router_api_key_file:
            raise ValueError("--router-api-key and --router-api-key-file: give one")
        self.replica_token()  # an unreadable or empty token file fails here, before anything starts
        self.registration_key()

    def replica_token(self) -> str | None:
        """The token every call to this replica (and from it to its KV peers) carries; None: open."""
        return load_replica_token(self.replica_token_file)

    def registration_key(self) -> str | None:
        """The router's admin key this replica registers with: --router-api-key, else the content of
        --router-api-key-file, else $PSRL_ROUTER_API_KEY."""
        if self.router_api_key:
            return self.router_api_key
        return load_secret(self.router_api_key_file, ROUTER_API_KEY_ENV, "--router-api-key-file")


def parse_args(argv: list[str] | None = None) -> WorkerArgs:
    argv = sys.argv[1:] if argv is None else argv
    engine_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, engine_args = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(prog="python -m psrl.worker [...] [-- vLLM engine arguments]", description=__doc__)
    d = WorkerArgs()
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=d.engine,
        help="reference: our reference engine; vllm: vLLM's AsyncLLM behind the stock smg-grpc-servicer",
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port (printed at start)")
    p.add_argument(
        "--model",
        default=d.model,
        help="model folder (config.json + tokenizer [+ weights]); default: the tiny Qwen2-style folder built locally",
    )
    p.add_argument("--served-model-name", default=d.served_model_name)
    p.add_argument("--dp-size", type=int, default=d.dp_size)
    p.add_argument("--seed", type=int, default=d.seed, help="weight seed when the folder has no weights")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--num-blocks", type=int, default=d.num_blocks)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn automatic prefix caching off (it is on by default, as in vLLM v1)",
    )
    p.add_argument("--device", default=d.device)
    p.add_argument("--router", default=d.router, help="router URL to register with (POST /workers)")
    p.add_argument(
        "--router-api-key",
        default=d.router_api_key,
        help=f"the router's admin key, to register with; other users can read a command line: prefer "
        f"--router-api-key-file or ${ROUTER_API_KEY_ENV}",
    )
    p.add_argument("--router-api-key-file", default=d.router_api_key_file, help="a file holding that key")
    p.add_argument(
        TOKEN_FILE_FLAG,
        dest="replica_token_file",
        default=d.replica_token_file,
        help=f"a file holding the shared token every gRPC call to this replica must carry (metadata "
        f"'authorization: Bearer <token>'; health and reflection stay open), also sent to KV peers; "
        f"default ${TOKEN_ENV}; neither: no token",
    )
    p.add_argument("--worker-id", default=d.worker_id, help="id to ask the router for")
    p.add_argument("--torch-threads", type=int, default=d.torch_threads, help="0 = torch's default")
    p.add_argument(
        "--kv-pin-ttl-s",
        type=float,
        default=d.kv_pin_ttl_s,
        help="a sync abort pins each request's KV this long for a peer to pull (KV migration; with --engine "
        "vllm this loads psrl's KV connector into vLLM); 0 = never pin",
    )
    p.add_argument(
        "--kv-shm-pool-mib",
        type=int,
        default=d.kv_shm_pool_mib,
        help="KV migration: shared memory kept mapped between transfers, on each side (MiB; 0 = a fresh "
        "segment per transfer)",
    )
    p.add_argument(
        "--kv-pin-max-mib",
        type=int,
        default=d.kv_pin_max_mib,
        help="--engine vllm: the most memory the KV of aborted requests kept for peers may take (MiB)",
    )
    try:
        args = WorkerArgs(**vars(p.parse_args(argv)), engine_args=engine_args)
        args.validate()
    except ValueError as e:
        p.error(str(e))
    return args


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
    migration = KvMigrationServicer(EngineKvHolder(engines), shm_pool_bytes=args.kv_shm_pool_mib << 20)
    kv_puller = KvPuller(migration.counters, target, shm_mappings_bytes=args.kv_shm_pool_mib << 20, token=token)
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

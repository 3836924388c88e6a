"""Replica settings (`python -m psrl.worker`): typed defaults, validated once at start, and the CLI that fills
them. Each setting is declared once, with its help text and unit (psrl.settings); the flags and
docs/configuration.md come from the declarations. The process itself is psrl/worker/server.py.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from psrl.credentials import ROUTER_API_KEY_ENV, TOKEN_ENV, TOKEN_FILE_FLAG, load_replica_token, load_secret
from psrl.settings import add_flags, apply_flags, setting

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
# Hosts that listen on every address: no peer can dial them.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


@dataclass
class WorkerArgs:
    engine: str = setting(
        "reference",
        help="reference: our reference engine; vllm: vLLM's AsyncLLM behind the stock smg-grpc-servicer",
        choices=ENGINES,
    )
    host: str = setting("127.0.0.1", help="address to listen on")
    advertise_host: str | None = setting(
        None,
        help="the host this replica registers with the router (which gives it to KV peers), when --host is not "
        "one others dial: 0.0.0.0, or one of several addresses; default: --host",
    )
    node_id: str | None = setting(
        None,
        help="the node this replica runs on: replicas of one node move KV through shared memory, others not "
        "(psrl.kv.choose_channel); default $PSRL_NODE_ID, else this host's name and boot id",
    )
    port: int = setting(0, help="gRPC port; 0: any free port (printed at start)")
    model: str | None = setting(
        None, help="model folder (config.json + tokenizer [+ weights]); default: a tiny Qwen2-style folder built here"
    )
    served_model_name: str | None = setting(None, help="the model name clients use; default: the folder's name")
    dp_size: int = setting(1, help="data-parallel ranks (engines) in this replica", unit="ranks")
    seed: int = setting(0, help="weight seed when the folder has no weights")
    block_size: int = setting(16, help="reference engine: tokens per KV block", unit="tokens")
    num_blocks: int = setting(1024, help="reference engine: KV blocks per rank", unit="blocks")
    max_num_seqs: int = setting(256, help="reference engine: sequences running at once per rank", unit="sequences")
    max_num_batched_tokens: int = setting(4096, help="reference engine: tokens per step per rank", unit="tokens")
    enable_prefix_caching: bool = setting(
        True, help="reference engine: automatic prefix caching, as in vLLM v1", flags=("--prefix-caching",)
    )
    device: str = setting("cpu", help="reference engine: torch device")
    router: str | None = setting(None, help="router URL to register with (POST /workers)")
    router_api_key: str | None = setting(
        None,
        help=f"the router's admin key, to register with; a command line is readable by other users: prefer "
        f"--router-api-key-file or ${ROUTER_API_KEY_ENV}",
    )
    router_api_key_file: str | None = setting(None, help="a file holding the router's admin key")
    replica_token_file: str | None = setting(
        None,
        help=f"a file with the shared token every gRPC call to this replica must carry (authorization: Bearer; "
        f"health and reflection stay open), also sent to KV peers; default ${TOKEN_ENV}; neither: no token",
        flags=(TOKEN_FILE_FLAG,),
    )
    worker_id: str | None = setting(None, help="the worker id to ask the router for")
    torch_threads: int = setting(0, help="reference engine: torch threads; 0: torch's default", unit="threads")
    kv_pin_ttl_s: float = setting(
        30.0,
        help="a sync abort pins each request's KV this long for a peer to pull (with --engine vllm this loads "
        "psrl's KV connector into vLLM); 0: never pin",
        unit="s",
    )
    kv_shm_pool_mib: int = setting(
        512,
        help="KV migration: shared memory kept mapped between transfers, each side; 0: one per transfer",
        unit="MiB",
    )
    kv_pin_max_mib: int = setting(
        1024, help="--engine vllm: memory the KV kept for peers (copies) may take at most", unit="MiB"
    )
    engine_args: list[str] = setting(
        default_factory=list, help="everything after `--`: vLLM's own engine arguments (--engine vllm)", flags=()
    )

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
        if self.router and self.host.strip("[]") in WILDCARD_HOSTS and not self.advertise_host:
            raise ValueError(
                f"--host {self.host} listens on every address, which a router cannot dial: give --advertise-host "
                "(the name or address the router and KV peers reach this replica at)"
            )
        if self.router_api_key and self.router_api_key_file:
            raise ValueError("--router-api-key and --router-api-key-file: give one")
        self.replica_token()  # an unreadable or empty token file fails here, before anything starts
        self.registration_key()

    def node(self) -> str:
        """The node id: --node-id, else this machine's (psrl.kv.local_node_id)."""
        from psrl.kv.placement import local_node_id  # here: psrl.kv loads numpy, and config modules stay light

        return self.node_id or local_node_id()

    def advertised(self, bound: str) -> str:
        """The `host:port` others reach this replica at, given the `host:port` its server is bound at."""
        if not self.advertise_host:
            return bound
        port = bound.rpartition(":")[2]
        host = self.advertise_host
        return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"

    def replica_token(self) -> str | None:
        """The token every call to this replica (and from it to its KV peers) carries; None: open."""
        return load_replica_token(self.replica_token_file)

    def registration_key(self) -> str | None:
        """The router's admin key this replica registers with: --router-api-key, else the content of
        --router-api-key-file, else $PSRL_ROUTER_API_KEY."""
        if self.router_api_key:
            return self.router_api_key
        return load_secret(self.router_api_key_file, ROUTER_API_KEY_ENV, "--router-api-key-file")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m psrl.worker [...] [-- vLLM engine arguments]",
        description="One replica process: the reference engine or vLLM, served over gRPC (psrl/worker/server.py).",
    )
    add_flags(p, WorkerArgs)
    return p


def parse_args(argv: list[str] | None = None) -> WorkerArgs:
    argv = sys.argv[1:] if argv is None else argv
    engine_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, engine_args = argv[:cut], argv[cut + 1 :]
    p = build_parser()
    args = WorkerArgs(engine_args=engine_args)
    try:
        apply_flags(args, p.parse_args(argv))
        args.validate()
    except ValueError as e:
        p.error(str(e))
    return args

"""Gateway settings (`python -m psrl.gateway`): typed defaults, read from flags and/or YAML, validated once at
start. Each setting is declared once, with its help text and unit (psrl.settings); the flags, the YAML keys and
docs/configuration.md come from the declarations. The launcher itself is psrl/gateway/launcher.py.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import yaml

from psrl.credentials import TOKEN_ENV, TOKEN_FILE_FLAG, load_replica_token
from psrl.router.policies import POLICIES, POLICY_ALIASES
from psrl.session.config import SESSION_STRATEGIES
from psrl.settings import add_flags, apply_flags, from_mapping, setting

REPLICA_ENGINES = ("reference", "vllm")


@dataclass
class GatewayConfig:
    host: str = setting(
        "127.0.0.1",
        help="address every process the gateway starts listens on (a node's IP in a cluster; 0.0.0.0: all, "
        "and they call each other on 127.0.0.1)",
    )
    router_port_start: int = setting(8100, help="the router takes the first free port from this one")
    session_port_start: int = setting(8200, help="the SessionRouter takes the first free port from this one")
    enable_session_router: bool = setting(True, help="also start a SessionRouter in front of the router")
    session_strategy: str = setting("none", help="the SessionRouter's --session-strategy", choices=SESSION_STRATEGIES)
    session_args: list[str] = setting(
        default_factory=list,
        help="everything after it goes to the SessionRouter, as given (e.g. --thunder-max-hold-s 600)",
        nargs=argparse.REMAINDER,
    )
    worker_urls: list[str] = setting(
        default_factory=list, help="replicas to route to (grpc://host:port); none: start replicas here"
    )
    policy: str = setting("round_robin", help="the router's --policy", choices=(*POLICIES, *POLICY_ALIASES))
    tokenizer_path: str | None = setting(None, help="the router's --tokenizer-path")
    api_key: str | None = setting(None, help="the router's --api-key")
    admin_api_key: str | None = setting(
        None, help="the router's --admin-api-key, also the SessionRouter's and the key replicas register with"
    )
    # Without it, the router and the replicas use $PSRL_REPLICA_TOKEN, which they inherit from the gateway.
    replica_token_file: str | None = setting(
        None,
        help=f"file with the replicas' shared gRPC token, for the router and the replicas; default ${TOKEN_ENV}",
        flags=(TOKEN_FILE_FLAG,),
    )
    # As PSRL launches the router: the routing loop on and the psrl selector (the router's default).
    enable_routing_loop: bool = setting(True, help="the router's --enable-routing-loop")
    psrl_ps_manager_addr: str = setting("", help="the router's --psrl-ps-manager-addr; empty: no PSManager")
    router_args: list[str] = setting(
        default_factory=list, help="everything after it goes to the router, as given", nargs=argparse.REMAINDER
    )
    # Replicas of the gateway's own, started only when worker_urls is empty.
    replica_engine: str = setting(
        "reference",
        help="the engine of the replicas started here (python -m psrl.worker --engine)",
        choices=REPLICA_ENGINES,
    )
    embedded_model: str | None = setting(
        None,
        help="model folder of those replicas; default: a tiny one built here (reference only)",
        flags=("--model", "--embedded-model"),
    )
    embedded_dp_sizes: list[int] | None = setting(
        None,
        help="one replica per entry, with that dp_size; default: 1 2 (reference), 1 (vllm); [] (YAML) or "
        "--replicas 0: none, replicas register themselves (POST /workers)",
        nargs="+",
    )
    replica_engine_args: list[str] = setting(
        default_factory=list, help="everything after it goes to each vLLM replica", nargs=argparse.REMAINDER
    )
    kv_transfer_enable: bool = setting(False, help="KV migration on loop-backs (the router's --kv-transfer-enable)")
    embedded_seed: int = setting(0, help="weight seed of the replicas started here")
    embedded_torch_threads: int = setting(1, help="torch threads of each reference replica started here")
    startup_timeout_s: float = setting(180.0, help="every process must be ready within this", unit="s")
    log_dir: str | None = setting(None, help="folder for one log file per process; default: the gateway's output")

    def validate(self) -> None:
        if self.worker_urls and self.embedded_dp_sizes == []:
            raise ValueError("embedded_dp_sizes [] starts no replicas; with worker_urls it says nothing: drop it")
        if any(d < 1 for d in self.replica_dp_sizes):
            raise ValueError("embedded_dp_sizes must all be >= 1")
        if self.replica_engine not in REPLICA_ENGINES:
            raise ValueError(f"replica_engine must be one of {REPLICA_ENGINES}")
        if self.replica_engine == "vllm" and not self.worker_urls and self.replica_dp_sizes and not self.embedded_model:
            raise ValueError("vLLM replicas need a model folder (--model DIR)")
        if self.replica_engine_args and self.replica_engine != "vllm":
            raise ValueError("replica_engine_args are vLLM engine arguments; they need replica_engine vllm")
        if self.session_strategy not in SESSION_STRATEGIES:
            raise ValueError(f"session_strategy must be one of {SESSION_STRATEGIES}")
        load_replica_token(self.replica_token_file)  # an unreadable or empty file fails here, not in a child

    @property
    def replica_dp_sizes(self) -> list[int]:
        if self.embedded_dp_sizes is not None:
            return self.embedded_dp_sizes
        return [1, 2] if self.replica_engine == "reference" else [1]

    @classmethod
    def from_yaml(cls, path: str | Path) -> GatewayConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
        return from_mapping(cls, data, str(path))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m psrl.gateway",
        description="Start the router and, when no worker_urls are given, replicas of its own; print how to call it.",
    )
    p.add_argument("--config", help="YAML file with GatewayConfig keys (flags override it)")
    p.add_argument(
        "--replicas",
        type=int,
        help="N replicas of dp_size 1 (instead of --embedded-dp-sizes); 0: none, replicas register themselves",
    )
    add_flags(p, GatewayConfig)
    return p


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    p = build_parser()
    ns = p.parse_args(argv)
    cfg = GatewayConfig.from_yaml(ns.config) if ns.config else GatewayConfig()
    apply_flags(cfg, ns)
    if ns.replicas is not None:
        if ns.replicas < 0:
            p.error("--replicas must be >= 0")
        cfg.embedded_dp_sizes = [1] * ns.replicas
    cfg.validate()
    return cfg

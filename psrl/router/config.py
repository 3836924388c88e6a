"""Router settings: typed defaults (nested dataclasses), read from flags and/or YAML, validated once at start."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from psrl.replica_auth import load_replica_token
from psrl.router.dispatch import KvTransferConfig
from psrl.router.health import BreakerConfig, HealthConfig
from psrl.router.pipeline.tool_calls import make_tool_parser
from psrl.router.policies.cache_aware import CacheAwareConfig
from psrl.router.routing_loop import RoutingLoopConfig
from psrl.router.selector import SelectorConfig
from psrl.router.tito_bridge import TitoConfig
from psrl.serving import HttpLimits

POLICIES = ("round_robin", "random", "power_of_two", "least_load", "consistent_hash", "cache_aware", "cache_aware_v1")
# PSRL's routing_strategy.method names for the same policies.
POLICY_ALIASES = {"request_num_balance": "least_load"}
CONNECTION_MODES = ("grpc", "http")


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8100
    worker_urls: list[str] = field(default_factory=list)
    connection_mode: str = "grpc"  # for --worker-urls
    policy: str = "round_robin"
    tokenizer_path: str | None = None
    api_key: str | None = None
    admin_api_key: str | None = None
    metrics_require_key: bool = False  # /metrics open (Prometheus on loopback) unless on: then the admin key
    replica_token_file: str | None = None  # the replicas' gRPC token; else $PSRL_REPLICA_TOKEN (psrl.replica_auth)
    request_timeout_s: float | None = None
    connect_timeout_s: float = 5.0
    load_poll_interval_s: float = 1.0  # GetLoads polling (least_load, cache_aware); 0 disables
    enable_kv_events: bool = True  # subscribe to workers' KV events (cache_aware_v1 only)
    max_payload_bytes: int = 64 << 20  # refused (413) while the body is read, before it is buffered
    client_header_timeout_s: float = 30.0  # a connection's request head must arrive within this (else closed)
    client_body_timeout_s: float = 30.0  # the longest pause inside a request body (else 408)
    graceful_shutdown_timeout_s: int = 10  # on SIGTERM, requests still open after this are cancelled
    log_level: str = "info"
    log_format: str = "text"
    tool_call_parser: str | None = None  # hermes/qwen format; None -> "qwen" (PSRL's default), "none" disables
    enable_partial_rollout: bool = True  # loop a sync-aborted request back with what it produced
    max_rollout_iterations: int = 64  # a request aborted this many times in a row fails (500)
    psrl_ps_manager_addr: str = ""  # host:port of the PSManager; "" disables selection stage 4
    psmanager_rpc_timeout_s: float = 5.0
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    selector: SelectorConfig = field(default_factory=SelectorConfig)
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    routing_loop: RoutingLoopConfig = field(default_factory=RoutingLoopConfig)
    kv_transfer: KvTransferConfig = field(default_factory=KvTransferConfig)
    tito: TitoConfig = field(default_factory=TitoConfig)

    def validate(self) -> None:
        self.policy = POLICY_ALIASES.get(self.policy, self.policy)
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.connection_mode not in CONNECTION_MODES:
            raise ValueError(f"connection_mode must be one of {CONNECTION_MODES}")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("request timeout must be positive")
        if self.log_format not in ("text", "json"):
            raise ValueError("log_format must be text or json")
        self.http_limits().validate()
        if self.graceful_shutdown_timeout_s < 0:
            raise ValueError("graceful_shutdown_timeout_s must be >= 0")
        self.health.validate()
        self.breaker.validate()
        self.selector.validate()
        self.cache_aware.validate()
        self.routing_loop.validate()
        self.kv_transfer.validate()
        self.tito.validate()
        make_tool_parser(self.tool_call_parser)  # raises on an unknown parser name
        if self.max_rollout_iterations < 1 or self.psmanager_rpc_timeout_s <= 0:
            raise ValueError("max_rollout_iterations must be >= 1 and psmanager_rpc_timeout_s positive")
        if self.metrics_require_key and not self.admin_api_key:
            raise ValueError("metrics_require_key needs admin_api_key: /metrics then takes the admin key")
        self.replica_token()  # an unreadable or empty token file fails here, at start

    def http_limits(self) -> HttpLimits:
        return HttpLimits(self.max_payload_bytes, self.client_header_timeout_s, self.client_body_timeout_s)

    def replica_token(self) -> str | None:
        """The token the router sends on every call to its replicas (None: it sends none)."""
        return load_replica_token(self.replica_token_file)


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    """A dataclass from a mapping, nested dataclasses included; unknown keys are an error naming them."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            kwargs[key] = _build(typing.cast(type, hint), value, f"{where}.{key}")
        else:
            kwargs[key] = value
    return cls(**kwargs)


def load_yaml(path: str | Path) -> RouterConfig:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping")
    return _build(RouterConfig, data, str(path))


def _add_dataclass_flags(p: argparse.ArgumentParser, cls: type, prefix: str) -> None:
    """--prefix-field flags for a nested config section (bools become --flag / --no-flag)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = f"--{prefix}{f.name.replace('_', '-')}"
        dest = f"{prefix.replace('-', '_')}{f.name}"
        hint = hints[f.name]
        if hint is bool:
            p.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None)
        else:
            base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
            p.add_argument(flag, dest=dest, type=base if base in (int, float, str) else str, default=None)


_SECTIONS = {
    "health": HealthConfig,
    "breaker": BreakerConfig,
    "selector": SelectorConfig,
    "cache_aware": CacheAwareConfig,
    "routing_loop": RoutingLoopConfig,
    "kv_transfer": KvTransferConfig,
    "tito": TitoConfig,
}
_FLAT_SECTIONS = ("selector", "cache_aware", "routing_loop", "tito")  # PSRL-style flat flags, e.g. --cache-threshold


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="python -m psrl.router", description="psrl-gateway router")
    p.add_argument("--config", help="YAML file with RouterConfig keys (flags override it)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument(
        "--worker-urls",
        nargs="*",
        help="workers to register: grpc://host:port (or http:// with --connection-mode http)",
    )
    p.add_argument("--connection-mode", choices=CONNECTION_MODES)
    p.add_argument("--policy", choices=[*POLICIES, *POLICY_ALIASES])
    p.add_argument("--tokenizer-path", help="local tokenizer folder; default: fetched from a worker (GetTokenizer)")
    p.add_argument("--api-key", help="data-plane bearer key (optional)")
    p.add_argument("--admin-api-key", help="bearer key for /workers* and /routing_loop* (optional)")
    p.add_argument(
        "--metrics-require-key",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="/metrics takes the admin key too (default: open, for scrapers on loopback)",
    )
    p.add_argument(
        "--replica-token-file",
        help="file with the replicas' shared gRPC token, sent on every call to them (default $PSRL_REPLICA_TOKEN)",
    )
    p.add_argument("--request-timeout-s", type=float)
    p.add_argument("--connect-timeout-s", type=float)
    p.add_argument("--load-poll-interval-s", type=float)
    p.add_argument("--enable-kv-events", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--max-payload-bytes", type=int, help="largest request body (default 64 MiB); larger is a 413")
    p.add_argument("--client-header-timeout-s", type=float, help="time for a request head to arrive (default 30)")
    p.add_argument("--client-body-timeout-s", type=float, help="longest pause inside a request body (default 30)")
    p.add_argument(
        "--graceful-shutdown-timeout-s", type=int, help="on SIGTERM, wait this long for open requests (default 10)"
    )
    p.add_argument("--tool-call-parser", help="hermes | qwen (default) | none")
    p.add_argument("--enable-partial-rollout", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--max-rollout-iterations", type=int)
    p.add_argument("--psrl-ps-manager-addr", help="PSManager host:port; empty disables selection stage 4")
    p.add_argument("--psmanager-rpc-timeout-s", type=float)
    p.add_argument("--log-level")
    p.add_argument("--log-format", choices=("text", "json"))
    # Flat PSRL-style names for the common sections, e.g. --worker-selection-strategy, --cache-threshold.
    for section, cls in _SECTIONS.items():
        _add_dataclass_flags(p, cls, "" if section in _FLAT_SECTIONS else f"{section.replace('_', '-')}-")
    ns = vars(p.parse_args(argv))
    config_path = ns.pop("config")
    cfg = load_yaml(config_path) if config_path else d
    for section, cls in _SECTIONS.items():
        prefix = "" if section in _FLAT_SECTIONS else f"{section}_"
        sub = getattr(cfg, section)
        for f in dataclasses.fields(cls):
            value = ns.pop(f"{prefix}{f.name}", None)
            if value is not None:
                setattr(sub, f.name, value)
    for key, value in ns.items():
        if value is not None:
            setattr(cfg, key, value)
    cfg.validate()
    return cfg


__all__ = ["POLICIES", "RouterConfig", "load_yaml", "parse_args"]

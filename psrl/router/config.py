"""Router settings: typed defaults (nested dataclasses), read from flags and/or YAML, validated once at start.

Each setting is declared once here, with its help text and unit (psrl.settings); the flags, the YAML keys and
docs/configuration.md come from these declarations. This module imports no router implementation.
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass
from pathlib import Path

import yaml

from psrl.credentials import DATA_API_KEY_ENV, ROUTER_API_KEY_ENV, TOKEN_ENV, env_secret, load_replica_token
from psrl.router.policies import POLICIES, POLICY_ALIASES
from psrl.serving.limits import HttpServerSettings
from psrl.settings import add_flags, apply_flags, choice, from_mapping, section, setting

# The tool-call parsers pipeline/tool_calls.py implements, by name. A null tool_call_parser (PSRL's YAML) means
# the Qwen/hermes format.
TOOL_PARSER_NAMES = ("hermes", "none", "qwen")
DEFAULT_TOOL_PARSER = "qwen"


class ConnectionMode(enum.StrEnum):
    GRPC = "grpc"
    HTTP = "http"


class LogFormat(enum.StrEnum):
    TEXT = "text"
    JSON = "json"


class SelectionStrategy(enum.StrEnum):
    PSRL = "psrl"  # the five selection steps for requests with PSRL metadata
    POLICY = "policy"  # availability and the policy only


class CandidateSortIndicator(enum.StrEnum):
    VERSION = "version"
    RESERVE_CAPABILITY = "reserve_capability"


class RequestSortIndicator(enum.StrEnum):
    SMALL_ID = "small_id"
    SHORT_LENGTH = "short_length"
    LONG_LENGTH = "long_length"


class KvTransferMode(enum.StrEnum):
    ASYNC = "async"
    SYNC = "sync"
    PIN_SYNC = "pin_sync"


@dataclass
class HealthConfig:
    """Active health checks of each worker."""

    failure_threshold: int = setting(3, help="consecutive failed checks that mark a healthy worker unhealthy")
    success_threshold: int = setting(2, help="consecutive passed checks that mark an unhealthy worker healthy")
    interval_s: float = setting(2.0, help="time between two checks of a worker", unit="s")
    timeout_s: float = setting(2.0, help="time one check may take", unit="s")

    def validate(self) -> None:
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError("health thresholds must be >= 1")
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError("health check interval and timeout must be positive")


@dataclass
class BreakerConfig:
    """The circuit breaker of each instance, fed by request outcomes."""

    failure_threshold: int = setting(5, help="consecutive failed requests on an instance that open its breaker")
    success_threshold: int = setting(1, help="successful trial requests in half-open that close it")
    open_duration_s: float = setting(10.0, help="time an open breaker waits before a trial request", unit="s")

    def validate(self) -> None:
        if self.failure_threshold < 1 or self.success_threshold < 1 or self.open_duration_s <= 0:
            raise ValueError("circuit breaker thresholds must be >= 1 and its open duration positive")


@dataclass
class SelectorConfig:
    """Instance selection (PSRL's five steps, psrl/router/selector.py)."""

    worker_selection_strategy: SelectionStrategy = setting(
        SelectionStrategy.PSRL, help="psrl: all five steps for PSRL requests; policy: availability and the policy"
    )
    candidate_sort_indicator: CandidateSortIndicator = setting(
        CandidateSortIndicator.VERSION, help="how the admission step orders and groups candidates"
    )
    enable_group_sticky: bool = setting(False, help="a prompt group stays on the instance of its first request")
    max_concurrent_seqs_per_instance: int = setting(
        1024, help="the admission gate: sequences in flight per instance", unit="sequences"
    )
    admission_reject_on_waiting: bool = setting(False, help="the gate also refuses instances with waiting requests")

    def validate(self) -> None:
        self.worker_selection_strategy = choice(
            SelectionStrategy, self.worker_selection_strategy, "worker_selection_strategy"
        )
        self.candidate_sort_indicator = choice(
            CandidateSortIndicator, self.candidate_sort_indicator, "candidate_sort_indicator"
        )
        if self.max_concurrent_seqs_per_instance < 1:
            raise ValueError("max_concurrent_seqs_per_instance must be >= 1")


@dataclass
class CacheAwareConfig:
    """The cache_aware and cache_aware_v1 policies: PSRL's `cache_aware_policy` section, with its defaults."""

    cache_threshold: float = setting(0.0, help="prefix match rate above which the best match wins", unit="fraction")
    balance_abs_threshold: int = setting(
        16, help="imbalanced when request counts differ by more than this (and the relative bound)", unit="requests"
    )
    balance_rel_threshold: float = setting(
        1.5, help="imbalanced also needs the busiest above this x the idlest", unit="factor"
    )
    balance_token_usage_threshold: float = setting(
        0.75, help="imbalanced when KV usage differs by more than this", unit="fraction"
    )
    overload_token_usage_threshold: float = setting(
        1.0, help="imbalanced when one instance's KV usage is above this", unit="fraction"
    )
    eviction_interval_secs: float = setting(60, help="the least time between two trims of the prefix trees", unit="s")
    max_tree_size: int = setting(2**26, help="prefix-tree size an instance is trimmed to", unit="tokens")
    block_size: int = setting(16, help="tokens per block when hashing prompts for KV events", unit="tokens")
    gpu_overlap_weight: float = setting(1.0, help="cache_aware_v1: score per GPU-cached block")
    lmcache_overlap_weight: float = setting(0.0, help="cache_aware_v1: score per LMCache-cached block")
    kv_capacity_threshold: float = setting(
        2.0, help="cache_aware_v1: new tokens must fit this x capacity minus KV in use", unit="factor"
    )

    def validate(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 0:
            raise ValueError("balance_abs_threshold and balance_rel_threshold must be >= 0")
        if self.balance_token_usage_threshold < 0 or self.overload_token_usage_threshold < 0:
            raise ValueError("balance_token_usage_threshold and overload_token_usage_threshold must be >= 0")
        if self.eviction_interval_secs <= 0:
            raise ValueError("eviction_interval_secs must be positive")
        if self.max_tree_size < 1 or self.block_size < 1:
            raise ValueError("max_tree_size and block_size must be >= 1")
        if self.kv_capacity_threshold <= 0:
            raise ValueError("kv_capacity_threshold must be positive")


@dataclass
class RoutingLoopConfig:
    """The routing loop: PSRL requests wait in a priority queue (psrl/router/routing_loop.py)."""

    enable_routing_loop: bool = setting(False, help="queue PSRL requests and place them from one loop")
    dispatch_batch_size: int = setting(1, help="requests one pass places at most", unit="requests")
    max_running_dispatch_tasks: int = setting(4096, help="placed requests in flight at most", unit="requests")
    request_sort_indicator: RequestSortIndicator = setting(
        RequestSortIndicator.SMALL_ID, help="the queue's order within a version: request id or prompt length"
    )
    enable_multi_priority_queue: bool = setting(False, help="one queue per version; the oldest drains first")
    check_interval_ms: int = setting(10, help="rest after a pass that placed nothing", unit="ms")
    max_attempts_per_pass: int = setting(256, help="unplaceable entries a pass tries before it rests", unit="entries")

    def validate(self) -> None:
        self.request_sort_indicator = choice(
            RequestSortIndicator, self.request_sort_indicator, "request_sort_indicator"
        )
        if self.dispatch_batch_size < 1 or self.max_running_dispatch_tasks < 1:
            raise ValueError("dispatch_batch_size and max_running_dispatch_tasks must be >= 1")
        if self.check_interval_ms < 1 or self.max_attempts_per_pass < 1:
            raise ValueError("check_interval_ms and max_attempts_per_pass must be >= 1")


@dataclass
class KvTransferConfig:
    """PSRL's `routing_strategy.kv_transfer`: a looped-back request tells its new instance where its KV is.

    `sync` and `pin_sync`: the replica pulls the KV before it queues the request; `async`: the request waits in
    the replica's queue while the KV is pulled. `pin_sync` takes only the KV the source pinned at the abort;
    the others also accept the source's prefix cache. A transfer not done in `transfer_timeout_ms` is dropped
    and the request prefilled instead.
    """

    enable: bool = setting(False, help="a looped-back request pulls its KV from the instance it left")
    transfer_mode: KvTransferMode = setting(
        KvTransferMode.ASYNC, help="sync/pin_sync: pull before queueing; async: while queued"
    )
    transfer_timeout_ms: int = setting(5000, help="a transfer not done by then is dropped (prefill instead)", unit="ms")

    def validate(self) -> None:
        self.transfer_mode = choice(KvTransferMode, self.transfer_mode, "kv_transfer.transfer_mode")
        if self.transfer_timeout_ms <= 0:
            raise ValueError("kv_transfer.transfer_timeout_ms must be > 0")


@dataclass
class TitoConfig:
    """TITO sessions: token-in, token-out chat turns recorded for training (psrl/router/tito_bridge.py)."""

    enable_tito: bool = setting(True, help="serve TITO sessions (session header on chat requests)")
    tito_debug: bool = setting(False, help="also re-tokenize each render and report where the ids depart")
    # GC never frees a sampled turn that an exported branch holds.
    tito_gc_threshold: int = setting(
        0, help="GC frees dropped branches once a session holds more nodes (0: after every turn)", unit="nodes"
    )
    tito_max_sessions: int = setting(10000, help="live sessions at most", unit="sessions")
    tito_max_turns: int = setting(1000, help="turns per session at most", unit="turns")
    tito_drop_dead_leaves: bool = setting(
        False, help="drop branches a history rewrite leaves behind from the snapshot (off: export every branch)"
    )
    max_trim_tokens: int = setting(0, help="tokens a snapshot may trim where a turn's ids depart", unit="tokens")
    tito_session_ttl_s: float = setting(
        3600.0, help="a session no request named this long (none in flight) expires; 0: never", unit="s"
    )
    tito_max_sessions_per_client: int = setting(
        0, help="with an api_key: live sessions per bearer credential; 0: no cap", unit="sessions"
    )
    tito_routed_experts: bool = setting(False, help="record each turn's MoE routed experts (for routing replay)")

    def validate(self) -> None:
        limits = (self.tito_gc_threshold, self.tito_max_sessions, self.tito_max_turns, self.max_trim_tokens)
        if min(*limits, self.tito_max_sessions_per_client) < 0 or not self.tito_session_ttl_s >= 0:
            raise ValueError("TITO limits (and tito_session_ttl_s) must be >= 0")


@dataclass
class RouterConfig(HttpServerSettings):
    host: str = setting("127.0.0.1", help="address to listen on")
    port: int = setting(8100, help="port to listen on; 0: any free port (printed on the ready line)")
    worker_urls: list[str] = setting(
        default_factory=list, help="workers to register at start: grpc://host:port (http:// with connection_mode http)"
    )
    connection_mode: ConnectionMode = setting(ConnectionMode.GRPC, help="how the router calls worker_urls")
    policy: str = setting(
        "round_robin",
        help="the policy that picks among candidates (request_num_balance: PSRL's name for least_load)",
        choices=(*POLICIES, *POLICY_ALIASES),
    )
    tokenizer_path: str | None = setting(None, help="local tokenizer folder; default: fetched from a worker")
    api_key: str | None = setting(None, help=f"bearer key of the data plane; default ${DATA_API_KEY_ENV}; none: open")
    admin_api_key: str | None = setting(
        None, help=f"bearer key of /workers* and /routing_loop*; default ${ROUTER_API_KEY_ENV}; none: open"
    )
    metrics_require_key: bool = setting(
        False, help="/metrics takes the admin key too (off: open, for scrapers on loopback)"
    )
    replica_token_file: str | None = setting(
        None, help=f"file with the replicas' gRPC token, sent on every call to them; default ${TOKEN_ENV}"
    )
    request_timeout_s: float | None = setting(None, help="a request not done by then fails; none: no limit", unit="s")
    connect_timeout_s: float = setting(5.0, help="time to connect to a worker", unit="s")
    load_poll_interval_s: float = setting(
        1.0, help="GetLoads polling of workers (least_load, cache_aware); 0: off", unit="s"
    )
    enable_kv_events: bool = setting(True, help="subscribe to workers' KV events (cache_aware_v1 only)")
    log_level: str = setting("info", help="debug, info, warning or error")
    log_format: LogFormat = setting(LogFormat.TEXT, help="text lines or one JSON object per line")
    tool_call_parser: str | None = setting(
        None,
        help=f"tool-call format in replies; unset: {DEFAULT_TOOL_PARSER}; none: no tool-call parsing",
        choices=TOOL_PARSER_NAMES,
    )
    enable_partial_rollout: bool = setting(True, help="loop a sync-aborted request back with what it produced")
    max_rollout_iterations: int = setting(64, help="a request aborted this many times in a row fails (500)")
    psrl_ps_manager_addr: str = setting("", help="PSManager host:port; empty: every candidate is admitted")
    psmanager_rpc_timeout_s: float = setting(5.0, help="time one PSManager call may take", unit="s")
    health: HealthConfig = section(HealthConfig)
    breaker: BreakerConfig = section(BreakerConfig)
    selector: SelectorConfig = section(SelectorConfig, flat=True)
    cache_aware: CacheAwareConfig = section(CacheAwareConfig, flat=True)
    routing_loop: RoutingLoopConfig = section(RoutingLoopConfig, flat=True)
    kv_transfer: KvTransferConfig = section(KvTransferConfig)
    tito: TitoConfig = section(TitoConfig, flat=True)

    def validate(self) -> None:
        self.policy = POLICY_ALIASES.get(self.policy, self.policy)
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        self.connection_mode = choice(ConnectionMode, self.connection_mode, "connection_mode")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("request timeout must be positive")
        self.log_format = choice(LogFormat, self.log_format, "log_format")
        self.validate_http()
        self.health.validate()
        self.breaker.validate()
        self.selector.validate()
        self.cache_aware.validate()
        self.routing_loop.validate()
        self.kv_transfer.validate()
        self.tito.validate()
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSER_NAMES:
            raise ValueError(
                f"unknown tool_call_parser {self.tool_call_parser!r}; known: {', '.join(TOOL_PARSER_NAMES)}"
            )
        if self.max_rollout_iterations < 1 or self.psmanager_rpc_timeout_s <= 0:
            raise ValueError("max_rollout_iterations must be >= 1 and psmanager_rpc_timeout_s positive")
        if self.metrics_require_key and not self.admin_api_key:
            raise ValueError("metrics_require_key needs admin_api_key: /metrics then takes the admin key")
        self.replica_token()  # an unreadable or empty token file fails here, at start

    def replica_token(self) -> str | None:
        """The token the router sends on every call to its replicas (None: it sends none)."""
        return load_replica_token(self.replica_token_file)


def load_yaml(path: str | Path) -> RouterConfig:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping")
    return from_mapping(RouterConfig, data, str(path))


def build_parser() -> argparse.ArgumentParser:
    """The router's flags: one per setting (PSRL-style flat names for the selector, cache_aware, routing loop
    and TITO sections, e.g. --cache-threshold; --health-*, --breaker-*, --kv-transfer-* for the others)."""
    p = argparse.ArgumentParser(prog="python -m psrl.router", description="psrl-gateway router")
    p.add_argument("--config", help="YAML file with RouterConfig keys (flags override it)")
    add_flags(p, RouterConfig)
    return p


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    ns = build_parser().parse_args(argv)
    cfg = load_yaml(ns.config) if ns.config else RouterConfig()
    apply_flags(cfg, ns)
    # Keys a launcher passes in the environment, where other users cannot read them (psrl.credentials).
    cfg.api_key = cfg.api_key or env_secret(DATA_API_KEY_ENV)
    cfg.admin_api_key = cfg.admin_api_key or env_secret(ROUTER_API_KEY_ENV)
    cfg.validate()
    return cfg


__all__ = ["POLICIES", "RouterConfig", "build_parser", "load_yaml", "parse_args"]

"""Router settings: typed defaults, validated once at start."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

POLICIES = ("round_robin",)


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8100
    worker_urls: list[str] = field(default_factory=list)
    policy: str = "round_robin"
    tokenizer_path: str | None = None
    api_key: str | None = None
    admin_api_key: str | None = None
    request_timeout_s: float | None = None
    connect_timeout_s: float = 5.0
    health_check_interval_s: float = 2.0
    health_check_timeout_s: float = 2.0
    max_payload_bytes: int = 64 << 20
    log_level: str = "info"

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("request timeout must be positive")
        if self.health_check_interval_s <= 0 or self.health_check_timeout_s <= 0:
            raise ValueError("health check interval and timeout must be positive")


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="python -m psrl.router", description="psrl-gateway router")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--worker-urls", nargs="*", default=[], help="grpc://host:port workers to register")
    p.add_argument("--policy", default=d.policy, choices=POLICIES)
    p.add_argument(
        "--tokenizer-path",
        default=d.tokenizer_path,
        help="local tokenizer folder; default: fetched from a worker with GetTokenizer",
    )
    p.add_argument("--api-key", default=d.api_key, help="data-plane bearer key (optional)")
    p.add_argument("--admin-api-key", default=d.admin_api_key, help="bearer key for /workers* (optional)")
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    p.add_argument("--connect-timeout-s", type=float, default=d.connect_timeout_s)
    p.add_argument("--health-check-interval-s", type=float, default=d.health_check_interval_s)
    p.add_argument("--health-check-timeout-s", type=float, default=d.health_check_timeout_s)
    p.add_argument("--max-payload-bytes", type=int, default=d.max_payload_bytes)
    p.add_argument("--log-level", default=d.log_level)
    cfg = RouterConfig(**vars(p.parse_args(argv)))
    cfg.validate()
    return cfg

"""SessionRouter configuration: typed defaults, validated once at start, and the CLI that fills them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from psrl.serving import HttpLimits


@dataclass
class SessionConfig:
    router_url: str = "http://127.0.0.1:8100"
    host: str = "127.0.0.1"
    port: int = 8200
    trajectory_id_strategy: str = "manual"  # manual: the client's id or "0"; auto: the router decides
    admin_api_key: str | None = None
    # Sent upstream as the bearer token when the client's request carries no Authorization of its own.
    router_api_key: str | None = None
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 3600.0
    max_connections: int = 1024
    max_payload_bytes: int = 64 << 20  # refused (413) while the body is read, before it is buffered
    client_header_timeout_s: float = 30.0  # a connection's request head must arrive within this (else closed)
    client_body_timeout_s: float = 30.0  # the longest pause inside a request body (else 408)
    graceful_shutdown_timeout_s: int = 10  # on SIGTERM, requests still open after this are cancelled
    log_level: str = "warning"

    def validate(self) -> None:
        if self.trajectory_id_strategy not in ("manual", "auto"):
            raise ValueError(f"trajectory_id_strategy must be manual or auto, got {self.trajectory_id_strategy!r}")
        if not self.router_url.startswith(("http://", "https://")):
            raise ValueError(f"router_url must be an http(s) URL, got {self.router_url!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if min(self.connect_timeout_s, self.request_timeout_s) <= 0 or self.max_connections <= 0:
            raise ValueError("timeouts and max_connections must be > 0")
        self.http_limits().validate()
        if self.graceful_shutdown_timeout_s < 0:
            raise ValueError("graceful_shutdown_timeout_s must be >= 0")
        self.router_url = self.router_url.rstrip("/")

    def http_limits(self) -> HttpLimits:
        return HttpLimits(self.max_payload_bytes, self.client_header_timeout_s, self.client_body_timeout_s)


def parse_args(argv: list[str] | None = None) -> SessionConfig:
    d = SessionConfig()
    p = argparse.ArgumentParser("python -m psrl.session", description="SessionRouter in front of the PSRL router")
    p.add_argument("--router-url", default=d.router_url)
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port and prints PSRL_SESSION_READY")
    p.add_argument("--trajectory-id-strategy", choices=["manual", "auto"], default=d.trajectory_id_strategy)
    p.add_argument("--admin-api-key", default=d.admin_api_key)
    p.add_argument(
        "--router-api-key",
        default=d.router_api_key,
        help="the router's --api-key, sent upstream when a client's request has no Authorization header",
    )
    p.add_argument("--connect-timeout-s", type=float, default=d.connect_timeout_s)
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    p.add_argument("--max-connections", type=int, default=d.max_connections)
    p.add_argument("--max-payload-bytes", type=int, default=d.max_payload_bytes, help="largest request body")
    p.add_argument("--client-header-timeout-s", type=float, default=d.client_header_timeout_s)
    p.add_argument("--client-body-timeout-s", type=float, default=d.client_body_timeout_s)
    p.add_argument("--graceful-shutdown-timeout-s", type=int, default=d.graceful_shutdown_timeout_s)
    p.add_argument("--log-level", default=d.log_level)
    a = p.parse_args(argv)
    config = SessionConfig(
        router_url=a.router_url,
        host=a.host,
        port=a.port,
        trajectory_id_strategy=a.trajectory_id_strategy,
        admin_api_key=a.admin_api_key,
        router_api_key=a.router_api_key,
        connect_timeout_s=a.connect_timeout_s,
        request_timeout_s=a.request_timeout_s,
        max_connections=a.max_connections,
        max_payload_bytes=a.max_payload_bytes,
        client_header_timeout_s=a.client_header_timeout_s,
        client_body_timeout_s=a.client_body_timeout_s,
        graceful_shutdown_timeout_s=a.graceful_shutdown_timeout_s,
        log_level=a.log_level,
    )
    config.validate()
    return config

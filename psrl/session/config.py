"""SessionRouter configuration: typed defaults, validated once at start, and the CLI that fills them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass
class SessionConfig:
    router_url: str = "http://127.0.0.1:8100"
    host: str = "127.0.0.1"
    port: int = 8200
    trajectory_id_strategy: str = "manual"  # manual: the client's id or "0"; auto: the router decides
    admin_api_key: str | None = None
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 3600.0
    max_connections: int = 1024
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
        self.router_url = self.router_url.rstrip("/")


def parse_args(argv: list[str] | None = None) -> SessionConfig:
    d = SessionConfig()
    p = argparse.ArgumentParser("python -m psrl.session", description="SessionRouter in front of the PSRL router")
    p.add_argument("--router-url", default=d.router_url)
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port and prints PSRL_SESSION_READY")
    p.add_argument("--trajectory-id-strategy", choices=["manual", "auto"], default=d.trajectory_id_strategy)
    p.add_argument("--admin-api-key", default=d.admin_api_key)
    p.add_argument("--connect-timeout-s", type=float, default=d.connect_timeout_s)
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    p.add_argument("--max-connections", type=int, default=d.max_connections)
    p.add_argument("--log-level", default=d.log_level)
    a = p.parse_args(argv)
    config = SessionConfig(
        router_url=a.router_url,
        host=a.host,
        port=a.port,
        trajectory_id_strategy=a.trajectory_id_strategy,
        admin_api_key=a.admin_api_key,
        connect_timeout_s=a.connect_timeout_s,
        request_timeout_s=a.request_timeout_s,
        max_connections=a.max_connections,
        log_level=a.log_level,
    )
    config.validate()
    return config

"""SessionRouter configuration: typed defaults, validated once at start, and the CLI that fills them.

Each setting is declared once, with its help text and unit (psrl.settings); the flags and
docs/configuration.md come from the declarations.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from psrl.serving.limits import HttpServerSettings
from psrl.settings import add_flags, apply_flags, setting


@dataclass
class SessionConfig(HttpServerSettings):
    router_url: str = setting("http://127.0.0.1:8100", help="the router this SessionRouter sends requests to")
    host: str = setting("127.0.0.1", help="address to listen on")
    port: int = setting(8200, help="port to listen on; 0: any free port (printed as PSRL_SESSION_READY)")
    trajectory_id_strategy: str = setting(
        "manual", help="manual: the client's trajectory id (or 0); auto: the router decides", choices=("manual", "auto")
    )
    admin_api_key: str | None = setting(
        None, help="key of the control endpoints (x-admin-api-key or bearer); none: open"
    )
    router_api_key: str | None = setting(
        None, help="the router's --api-key, sent upstream when a client's request has no Authorization header"
    )
    connect_timeout_s: float = setting(10.0, help="time to connect to the router", unit="s")
    request_timeout_s: float = setting(3600.0, help="a request to the router not done by then fails", unit="s")
    max_connections: int = setting(1024, help="connections to the router at most", unit="connections")
    log_level: str = setting("warning", help="debug, info, warning or error")

    def validate(self) -> None:
        if self.trajectory_id_strategy not in ("manual", "auto"):
            raise ValueError(f"trajectory_id_strategy must be manual or auto, got {self.trajectory_id_strategy!r}")
        if not self.router_url.startswith(("http://", "https://")):
            raise ValueError(f"router_url must be an http(s) URL, got {self.router_url!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if min(self.connect_timeout_s, self.request_timeout_s) <= 0 or self.max_connections <= 0:
            raise ValueError("timeouts and max_connections must be > 0")
        self.validate_http()
        self.router_url = self.router_url.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("python -m psrl.session", description="SessionRouter in front of the PSRL router")
    add_flags(p, SessionConfig)
    return p


def parse_args(argv: list[str] | None = None) -> SessionConfig:
    config = SessionConfig()
    apply_flags(config, build_parser().parse_args(argv))
    config.validate()
    return config

"""SessionRouter configuration: typed defaults, validated once at start, and the CLI that fills them.

Each setting is declared once, with its help text and unit (psrl.settings); the flags and
docs/configuration.md come from the declarations.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from psrl.credentials import DATA_API_KEY_ENV, ROUTER_API_KEY_ENV, SESSION_API_KEY_ENV, env_secret
from psrl.serving.limits import HttpServerSettings
from psrl.settings import add_flags, apply_flags, section, setting

SESSION_STRATEGIES = ("none", "thunder_agent")
CONTINUE_SCOPES = ("bucketed", "global")


@dataclass
class ThunderConfig:
    """The thunder_agent session strategy (--session-strategy thunder_agent): hangs sessions at their turn
    boundary when an instance's KV cache cannot hold them, and continues them when it can."""

    check_interval_ms: int = setting(1000, help="time between two rounds of the strategy", unit="ms")
    env_token_weight: float = setting(
        1.0, help="what a session between turns counts of its tokens (1: all of them stay in the KV cache)"
    )
    buffer_per_session: int = setting(
        100, help="tokens reserved per session on its instance for what it decodes next", unit="tokens"
    )
    continue_scope: str = setting(
        "bucketed",
        help="bucketed: a hung session continues on its own instance; global: on the instance it fits best",
        choices=CONTINUE_SCOPES,
    )
    continue_force_pin: bool = setting(
        False, help="a continued session's next turn is force-pinned to the instance the strategy placed it on"
    )
    max_hold_s: float = setting(
        1800.0, help="a session held this long is continued whatever the capacity (nothing starves)", unit="s"
    )
    credit_shared_prefix: bool = setting(
        True,
        help="count generating sessions' tokens past the KV in use as a shared prefix (PSRL's formula); off: count "
        "them in full, for replicas that queue turns (their KV is not in use yet)",
    )

    def validate(self) -> None:
        if self.check_interval_ms <= 0:
            raise ValueError(f"thunder check_interval_ms must be > 0, got {self.check_interval_ms}")
        if not self.env_token_weight >= 0:
            raise ValueError(f"thunder env_token_weight must be >= 0, got {self.env_token_weight}")
        if self.buffer_per_session < 0:
            raise ValueError(f"thunder buffer_per_session must be >= 0, got {self.buffer_per_session}")
        if self.continue_scope not in CONTINUE_SCOPES:
            raise ValueError(f"thunder continue_scope must be one of {CONTINUE_SCOPES}, got {self.continue_scope!r}")
        if self.max_hold_s <= 0:
            raise ValueError(f"thunder max_hold_s must be > 0, got {self.max_hold_s}")


@dataclass
class SessionConfig(HttpServerSettings):
    router_url: str = setting("http://127.0.0.1:8100", help="the router this SessionRouter sends requests to")
    host: str = setting("127.0.0.1", help="address to listen on")
    port: int = setting(8200, help="port to listen on; 0: any free port (printed as PSRL_SESSION_READY)")
    trajectory_id_strategy: str = setting(
        "manual", help="manual: the client's trajectory id (or 0); auto: the router decides", choices=("manual", "auto")
    )
    admin_api_key: str | None = setting(
        None,
        help=f"key of the control endpoints (x-admin-api-key or bearer); default ${SESSION_API_KEY_ENV}; none: open",
    )
    router_api_key: str | None = setting(
        None,
        help=f"the router's --api-key, sent upstream when a client's request has no Authorization header; "
        f"default ${DATA_API_KEY_ENV}",
    )
    connect_timeout_s: float = setting(10.0, help="time to connect to the router", unit="s")
    request_timeout_s: float = setting(3600.0, help="a request to the router not done by then fails", unit="s")
    max_connections: int = setting(1024, help="connections to the router at most", unit="connections")
    log_level: str = setting("warning", help="debug, info, warning or error")
    session_strategy: str = setting(
        "none",
        help="none: sessions run as their clients send turns; thunder_agent: hang and continue them by KV capacity",
        choices=SESSION_STRATEGIES,
    )
    router_admin_api_key: str | None = setting(
        None,
        help=f"the router's --admin-api-key, for the strategy's reads of /workers and /workers/stats; "
        f"default ${ROUTER_API_KEY_ENV}",
    )
    thunder: ThunderConfig = section(ThunderConfig)

    def validate(self) -> None:
        if self.trajectory_id_strategy not in ("manual", "auto"):
            raise ValueError(f"trajectory_id_strategy must be manual or auto, got {self.trajectory_id_strategy!r}")
        if not self.router_url.startswith(("http://", "https://")):
            raise ValueError(f"router_url must be an http(s) URL, got {self.router_url!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if min(self.connect_timeout_s, self.request_timeout_s) <= 0 or self.max_connections <= 0:
            raise ValueError("timeouts and max_connections must be > 0")
        if self.session_strategy not in SESSION_STRATEGIES:
            raise ValueError(f"session_strategy must be one of {SESSION_STRATEGIES}, got {self.session_strategy!r}")
        self.thunder.validate()
        self.validate_http()
        self.router_url = self.router_url.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("python -m psrl.session", description="SessionRouter in front of the PSRL router")
    add_flags(p, SessionConfig)
    return p


def parse_args(argv: list[str] | None = None) -> SessionConfig:
    config = SessionConfig()
    apply_flags(config, build_parser().parse_args(argv))
    # Keys a launcher passes in the environment, where other users cannot read them (psrl.credentials).
    config.admin_api_key = config.admin_api_key or env_secret(SESSION_API_KEY_ENV)
    config.router_api_key = config.router_api_key or env_secret(DATA_API_KEY_ENV)
    config.router_admin_api_key = config.router_admin_api_key or env_secret(ROUTER_API_KEY_ENV)
    config.validate()
    return config

"""What bounds a connection to our HTTP servers, as settings: light (no server code), so config modules take it."""

from __future__ import annotations

from dataclasses import dataclass

from psrl.settings import setting


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = 64 << 20
    header_timeout_s: float = 30.0  # the whole request head, from the connection's (or request's) first byte
    body_timeout_s: float = 30.0  # the longest silence while a request body is being received

    def validate(self) -> None:
        if self.max_body_bytes <= 0:
            raise ValueError("max_payload_bytes must be > 0")
        if self.header_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError("client header and body timeouts must be > 0")


@dataclass
class HttpServerSettings:
    """The settings every HTTP server of ours takes (the router's and the SessionRouter's configs extend it)."""

    max_payload_bytes: int = setting(64 << 20, help="largest request body; larger is a 413", unit="bytes")
    client_header_timeout_s: float = setting(
        30.0, help="a request head must arrive within this, else the connection closes", unit="s"
    )
    client_body_timeout_s: float = setting(30.0, help="longest pause inside a request body (else 408)", unit="s")
    graceful_shutdown_timeout_s: int = setting(
        10, help="on SIGTERM, requests still open after this are cancelled", unit="s"
    )

    def http_limits(self) -> HttpLimits:
        return HttpLimits(self.max_payload_bytes, self.client_header_timeout_s, self.client_body_timeout_s)

    def validate_http(self) -> None:
        self.http_limits().validate()
        if self.graceful_shutdown_timeout_s < 0:
            raise ValueError("graceful_shutdown_timeout_s must be >= 0")

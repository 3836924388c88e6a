"""`python -m psrl.router`: serve the router on uvicorn (uvloop + httptools, bounded per connection). Once it
listens it prints `PSRL_ROUTER_READY <url>` on stdout, with the port it got when started with `--port 0`."""

from __future__ import annotations

import json

import uvicorn

from psrl.router.app import RouterApp
from psrl.router.config import RouterConfig, parse_args
from psrl.router.errors import BadRequest
from psrl.router.logs import configure_logging
from psrl.serving.protocol import guarded_protocol
from psrl.serving.server import AnnouncingServer, run_server

READY_MARKER = "PSRL_ROUTER_READY"


def render_error(code: str, message: str) -> bytes:
    """The router's JSON error for what the HTTP layer refuses (too large, too slow, malformed framing)."""
    return json.dumps(BadRequest(message, code=code).body()).encode()


def run(config: RouterConfig) -> None:
    server = AnnouncingServer(
        uvicorn.Config(
            RouterApp(config).app,
            host=config.host,
            port=config.port,
            loop="uvloop",
            http=guarded_protocol(config.http_limits(), render_error),
            ws="none",
            # Per-request work nothing here needs: X-Forwarded-* rewriting of the scope's client and scheme (which
            # the router never reads) and the `server: uvicorn` header. The Date header stays (RFC 9110).
            proxy_headers=False,
            server_header=False,
            log_level=config.log_level,
            log_config=None,  # keep our structured handler
            access_log=False,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=config.graceful_shutdown_timeout_s,
        ),
        READY_MARKER,
        tune_gc=True,
    )
    run_server(server)


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    configure_logging(config.log_level, config.log_format)
    run(config)

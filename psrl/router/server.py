"""`python -m psrl.router`: serve the router: its routes on our bare HTTP/1.1 protocol (`psrl.serving.http1`:
httptools on uvloop, bounded per connection) inside uvicorn's server. Once it listens it prints
`PSRL_ROUTER_READY <url>` on stdout, with the port it got when started with `--port 0`."""

from __future__ import annotations

import json

import uvicorn

from psrl.router.app import RouterApp
from psrl.router.config import RouterConfig, parse_args
from psrl.router.errors import BadRequest
from psrl.router.logs import configure_logging
from psrl.serving.http1 import http1_protocol
from psrl.serving.server import AnnouncingServer, run_server

READY_MARKER = "PSRL_ROUTER_READY"


def render_error(code: str, message: str) -> bytes:
    """The router's JSON error for what the HTTP layer refuses (too large, too slow, malformed framing)."""
    return json.dumps(BadRequest(message, code=code).body()).encode()


def uvicorn_config(router: RouterApp) -> uvicorn.Config:
    """uvicorn's server for the router: its listening socket, signals and lifespan, with our protocol per
    connection."""
    config = router.config
    app = router.app
    return uvicorn.Config(
        app,  # the ASGI lifespan only: requests go to `app.handle`
        host=config.host,
        port=config.port,
        loop="uvloop",
        http=http1_protocol(app.handle, config.http_limits(), render_error),
        ws="none",
        # X-Forwarded-* rewriting (of an ASGI scope the requests no longer get) stays off, and so does the
        # `server: uvicorn` header. The Date header stays (RFC 9110).
        proxy_headers=False,
        server_header=False,
        log_level=config.log_level,
        log_config=None,  # keep our structured handler
        access_log=False,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=config.graceful_shutdown_timeout_s,
    )


def run(config: RouterConfig) -> None:
    run_server(AnnouncingServer(uvicorn_config(RouterApp(config)), READY_MARKER, tune_gc=True))


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    configure_logging(config.log_level, config.log_format)
    run(config)

"""`python -m psrl.router`: serve the router on uvicorn (uvloop + httptools, bounded per connection)."""

from __future__ import annotations

import json

import uvicorn

from psrl.router.app import RouterApp
from psrl.router.config import RouterConfig, parse_args
from psrl.router.errors import BadRequest
from psrl.router.logs import configure_logging
from psrl.serving import guarded_protocol


def render_error(code: str, message: str) -> bytes:
    """The router's JSON error for what the HTTP layer refuses (too large, too slow, malformed framing)."""
    return json.dumps(BadRequest(message, code=code).body()).encode()


def run(config: RouterConfig) -> None:
    app = RouterApp(config).app
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        http=guarded_protocol(config.http_limits(), render_error),
        ws="none",
        log_level=config.log_level,
        log_config=None,  # keep our structured handler
        access_log=False,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=config.graceful_shutdown_timeout_s,
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    configure_logging(config.log_level, config.log_format)
    run(config)

"""`python -m psrl.session`: serve the SessionRouter on uvicorn (httptools, bounded per connection). Once it
listens it prints `PSRL_SESSION_READY <url>` on stdout, with the port it got when started with `--port 0`."""

from __future__ import annotations

import uvicorn

from psrl.serving.protocol import guarded_protocol
from psrl.serving.server import AnnouncingServer, run_server
from psrl.session.app import create_app, render_error
from psrl.session.config import SessionConfig, parse_args

READY_MARKER = "PSRL_SESSION_READY"


def run(config: SessionConfig) -> None:
    server = AnnouncingServer(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            http=guarded_protocol(config.http_limits(), render_error),
            ws="none",
            log_level=config.log_level,
            access_log=False,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=config.graceful_shutdown_timeout_s,
        ),
        READY_MARKER,
    )
    run_server(server)


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))

"""`python -m psrl.session`: serve the SessionRouter on uvicorn (httptools, bounded per connection); `--port 0`
announces the address it got."""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from psrl.serving import guarded_protocol
from psrl.session.app import create_app, render_error
from psrl.session.config import SessionConfig, parse_args

READY_MARKER = "PSRL_SESSION_READY"


async def _announce_when_started(server: uvicorn.Server, url: str) -> None:
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.02)
    print(f"{READY_MARKER} {url}", flush=True)


async def serve(config: SessionConfig) -> None:
    # Bind first so that port 0 resolves to a real port we can announce.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            http=guarded_protocol(config.http_limits(), render_error),
            ws="none",
            log_level=config.log_level,
            access_log=False,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=config.graceful_shutdown_timeout_s,
        )
    )
    announce = asyncio.create_task(_announce_when_started(server, f"http://{config.host}:{port}"))
    try:
        await server.serve(sockets=[sock])
    finally:
        announce.cancel()
        sock.close()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(parse_args(argv)))

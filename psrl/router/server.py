"""`python -m psrl.router`: serve the router on uvicorn (uvloop + httptools)."""

from __future__ import annotations

import uvicorn

from psrl.router.app import RouterApp
from psrl.router.config import RouterConfig, parse_args
from psrl.router.logs import configure_logging


def run(config: RouterConfig) -> None:
    app = RouterApp(config).app
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        log_level=config.log_level,
        log_config=None,  # keep our structured handler
        access_log=False,
        timeout_keep_alive=30,
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    configure_logging(config.log_level, config.log_format)
    run(config)

"""`python -m psrl.router`: serve the router on uvicorn (uvloop + httptools)."""

from __future__ import annotations

import logging

import uvicorn

from psrl.router.app import RouterApp
from psrl.router.config import RouterConfig, parse_args


def run(config: RouterConfig) -> None:
    app = RouterApp(config).app
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        log_level=config.log_level,
        access_log=False,
        timeout_keep_alive=30,
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(config)

"""PSManager settings (`python -m psrl.psmanager`): typed defaults, validated once at start, and the CLI that
fills them. Each setting is declared once, with its help text (psrl.settings); the flags and
docs/configuration.md come from the declarations. The service itself is psrl/psmanager/server.py.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from psrl.psmanager.state import PSManagerConfig
from psrl.settings import add_flags, apply_flags, setting


@dataclass
class ServerArgs:
    host: str = setting("127.0.0.1", help="address to listen on")
    port: int = setting(0, help="gRPC port; 0: any free port (printed on the ready line)")
    rollout_n: int = setting(1, help="requests per prompt group", unit="requests")
    entries_per_buffer: int = setting(64, help="prompt groups per buffer", unit="groups")
    max_pending_buffers: int = setting(2, help="unconsumed buffers per version", unit="buffers")
    max_staleness: int = setting(1, help="versions older than latest - this take no new entries", unit="versions")
    log_level: str = setting("INFO", help="DEBUG, INFO, WARNING or ERROR")

    def config(self) -> PSManagerConfig:
        return PSManagerConfig(
            rollout_n=self.rollout_n,
            entries_per_buffer=self.entries_per_buffer,
            max_pending_buffers=self.max_pending_buffers,
            max_staleness=self.max_staleness,
        )

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("--port must be in [0, 65535]")
        self.config().validate()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m psrl.psmanager", description="PSRL's PSManager (psrl.state.PSManagerState) over gRPC"
    )
    add_flags(p, ServerArgs)
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    p = build_parser()
    args = ServerArgs()
    apply_flags(args, p.parse_args(argv))
    try:
        args.validate()
    except ValueError as e:
        p.error(str(e))
    return args

"""Running a uvicorn server the way our processes start: a ready line once it listens, and a failed start exits
non-zero (as `uvicorn.run` does)."""

from __future__ import annotations

import gc
import socket
import sys

import uvicorn
from uvicorn.main import STARTUP_FAILURE


class AnnouncingServer(uvicorn.Server):
    """uvicorn's server that prints `<marker> http://host:port` on stdout once it listens (after the app's
    lifespan startup), with the port it got when started on port 0; launchers and tests wait for that line.

    With `freeze_heap`, what start-up built (modules, the app and its state: tens of thousands of objects) is
    moved out of the cyclic GC's reach just before that line (`gc.freeze()`, after a collection): under load the
    full collections the requests' short-lived objects trigger no longer walk all of it each time."""

    def __init__(self, config: uvicorn.Config, marker: str, *, freeze_heap: bool = False) -> None:
        super().__init__(config)
        self.marker = marker
        self.freeze_heap = freeze_heap

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:  # the app's startup failed: nothing listens
            return
        if self.freeze_heap:
            gc.collect()
            gc.freeze()
        port = self.servers[0].sockets[0].getsockname()[1]
        print(f"{self.marker} http://{self.config.host}:{port}", flush=True)


def run_server(server: AnnouncingServer) -> None:
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:
        sys.exit(STARTUP_FAILURE)

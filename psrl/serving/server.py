"""Running a uvicorn server the way our processes start: a ready line once it listens, and a failed start exits
non-zero (as `uvicorn.run` does)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import socket
import sys
from collections.abc import Callable

import uvicorn
from uvicorn.main import STARTUP_FAILURE


class AnnouncingServer(uvicorn.Server):
    """uvicorn's server that prints `<marker> http://host:port` on stdout once it listens (after the app's
    lifespan startup), with the port it got when started on port 0; launchers and tests wait for that line.

    With `tune_gc`, the cyclic GC is set for a server whose objects live as long as a request, just before that
    line:
    - What start-up built (modules, the app and its state: tens of thousands of objects) is moved out of the
      GC's reach (`gc.freeze()`, after a collection), so the full collections under load no longer walk it.
    - The youngest generation is collected after `YOUNG_THRESHOLD` net allocations, not 700. Its count is
      allocations minus deallocations, so at the default a few dozen requests in flight (each holding some
      hundred containers) keep passing it: every collection walked all their live objects, and moved them to
      the older generations to be walked again. That cost the router about 30 us a request at 64 connections.
      Freed request state now keeps the count down, and what grows it is garbage refcounting cannot free
      (cycles): at most that many objects of it wait for a collection.

    uvicorn's main loop wakes ten times a second to see whether `should_exit` was set; this one sleeps until it
    is set (by a signal, or by whoever holds the server) and wakes once a second only to refresh the `date`
    header. An idle process's wakes are its CPU: the router's, with no workers, went from 1.5-2.0 to 0-0.5 ms/s."""

    YOUNG_THRESHOLD = 10_000
    TICK_S = 1.0  # between two of uvicorn's ticks (the date header is refreshed on each)
    _wake: Callable[[], object] | None = None  # set while main_loop runs: ends its wait, from any thread

    def __init__(self, config: uvicorn.Config, marker: str, *, tune_gc: bool = False) -> None:
        super().__init__(config)
        self.marker = marker
        self.tune_gc = tune_gc

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:  # the app's startup failed: nothing listens
            return
        if self.tune_gc:
            tune_gc()
        port = self.servers[0].sockets[0].getsockname()[1]
        print(f"{self.marker} http://{self.config.host}:{port}", flush=True)

    @property  # uvicorn.Server's attribute; setting it also wakes main_loop
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        if value and self._wake is not None:
            self._wake()

    async def main_loop(self) -> None:
        """uvicorn's `main_loop`, woken by `should_exit` rather than polling it: each pass is one of uvicorn's
        once-a-second ticks (the date header, the request limit, the exit check)."""
        exiting = asyncio.Event()
        self._wake = functools.partial(asyncio.get_running_loop().call_soon_threadsafe, exiting.set)
        try:
            while not await self.on_tick(0):  # tick 0: uvicorn's counter at a whole second
                exiting.clear()  # a wake whose `should_exit` was set back to False: wait again, do not spin
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.TICK_S):
                        await exiting.wait()
        finally:
            self._wake = None


def tune_gc() -> None:
    """The GC as `AnnouncingServer(tune_gc=True)` sets it once it listens (see there): what is alive now frozen,
    the young generation collected after `AnnouncingServer.YOUNG_THRESHOLD` net allocations. For code that runs a
    server's handlers without the server, such as a bench in process."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(AnnouncingServer.YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def run_server(server: AnnouncingServer) -> None:
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:
        sys.exit(STARTUP_FAILURE)

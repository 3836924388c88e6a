"""KV migration between reference replicas: the source's `psrl.kv.KvMigration` service and the destination's
pull of a looped-back request's KV (driven by `kv_transfer_params_json` in its GenerateRequest).

The destination pulls: it keeps what its own prefix cache holds of the prompt, and TransferKv asks the source
to gather the rest of the longest prefix of the destination's prompt that it holds (the request's pin from the
sync abort, or with no pin and when allowed, full blocks of its prefix cache) straight into a POSIX
shared-memory segment; the destination reserves blocks, scatters the segment into them (planned with
psrl.kv.plan_transfer), acknowledges with ReleaseKv, and admits the request with that KV (PreloadedKV), so
only the last prompt token is prefilled. Any failure (source gone, timeout, nothing held, layout mismatch, no
room) falls back to recompute: slower, never wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import grpc

from psrl._proto import kv_migration_pb2, kv_migration_pb2_grpc
from psrl.engine import AsyncEngine, InvalidRequestError, PreloadedKV
from psrl.kv import KVLayoutSpec, LayoutError, check_compatible, plan_transfer
from psrl.kv.channels import ShmChannel, ShmMappings, ShmPool, ShmTransfer, shm_receive, shm_send

logger = logging.getLogger(__name__)

T = TypeVar("T")
TransferMode = Literal["async", "sync", "pin_sync"]
TRANSFER_MODES: tuple[TransferMode, ...] = ("async", "sync", "pin_sync")
# A gathered segment the peer never acknowledged is freed after this long (swept every quarter of it).
UNACKED_TRANSFER_TTL_S = 60.0


_layouts: weakref.WeakKeyDictionary[AsyncEngine, KVLayoutSpec] = weakref.WeakKeyDictionary()


def layout_of(engine: AsyncEngine) -> KVLayoutSpec:
    """What two replicas must agree on to exchange blocks (described once per engine: its cache never changes)."""
    layout = _layouts.get(engine)
    if layout is None:
        layout = _layouts[engine] = KVLayoutSpec.describe(engine.engine.kv_cache.layers)
    return layout


@dataclass
class MigrationCounters:
    """One dp rank's migration counters (KvMigrationStats)."""

    transfers_out: int = 0
    bytes_out: int = 0
    transfers_in: int = 0
    bytes_in: int = 0
    tokens_in: int = 0
    transfer_seconds_in: float = 0.0
    fallbacks: int = 0


@dataclass
class _Outgoing:
    channel: ShmChannel
    rank: int
    request_id: str
    keep_pin: bool
    created: float = field(default_factory=time.monotonic)


async def _in_thread(fn: Callable[..., T], *args: Any, discard: Callable[[T], None] | None = None, **kwargs: Any) -> T:
    """Run a block copy in a worker thread. A cancellation (an RPC deadline) waits for the copy to end before it
    propagates, so the caller never frees blocks a copy still reads or writes; `discard` cleans up a result
    nobody will use."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():  # a second cancellation must not cut this wait short either
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([task])
        if discard is not None and not task.cancelled() and task.exception() is None:
            discard(task.result())
        raise


class KvMigrationServicer(kv_migration_pb2_grpc.KvMigrationServicer):
    """The source side, one instance per replica over its dp ranks' engines; also holds every rank's counters
    (the destination side, KvPuller, adds to them)."""

    def __init__(self, engines: list[AsyncEngine], *, shm_pool_bytes: int = 0) -> None:
        self.engines = engines
        self.counters = [MigrationCounters() for _ in engines]
        # Segments kept between transfers (0: a fresh segment per transfer); see psrl.kv.ShmPool.
        self.shm_pool = ShmPool(shm_pool_bytes) if shm_pool_bytes > 0 else None
        self._outgoing: dict[str, _Outgoing] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Remove segments dead replicas left behind, and start freeing segments no peer acknowledged (call with
        the server's event loop running)."""
        removed = remove_stale_segments()
        if removed:
            logger.info("removed %d shared-memory segment(s) left by dead processes", removed)

        async def sweep() -> None:
            while True:
                await asyncio.sleep(UNACKED_TRANSFER_TTL_S / 4)
                await self._end(self._expired(), read=False)

        self._sweeper = asyncio.create_task(sweep())

    async def _rank(self, rank: int, context: grpc.aio.ServicerContext) -> AsyncEngine:
        if not 0 <= rank < len(self.engines):
            message = f"data_parallel_rank {rank} is out of range for dp_size {len(self.engines)}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        return self.engines[rank]

    async def PinKv(
        self, request: kv_migration_pb2.PinKvRequest, context: grpc.aio.ServicerContext
    ) -> kv_migration_pb2.PinKvResponse:
        engine = await self._rank(request.data_parallel_rank, context)
        try:
            n = engine.engine.pin_kv(request.request_id, request.ttl_ms / 1000.0)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return kv_migration_pb2.PinKvResponse(num_tokens=n)

    async def UnpinKv(
        self, request: kv_migration_pb2.UnpinKvRequest, context: grpc.aio.ServicerContext
    ) -> kv_migration_pb2.UnpinKvResponse:
        engine = await self._rank(request.data_parallel_rank, context)
        return kv_migration_pb2.UnpinKvResponse(unpinned=engine.engine.unpin_kv(request.request_id))

    async def TransferKv(
        self, request: kv_migration_pb2.TransferKvRequest, context: grpc.aio.ServicerContext
    ) -> kv_migration_pb2.TransferKvResponse:
        rank = request.data_parallel_rank
        engine = await self._rank(rank, context)
        await self._end(self._expired(), read=False)
        if request.channel not in ("", "shm"):
            return kv_migration_pb2.TransferKvResponse(reason=f"channel {request.channel!r} is not served here")
        if request.layout_json:
            try:
                check_compatible(layout_of(engine), json.loads(request.layout_json))
            except (ValueError, LayoutError) as e:
                return kv_migration_pb2.TransferKvResponse(reason=f"layout mismatch: {e}")
        tokens = list(request.token_ids)[: request.max_tokens or None]
        start = request.start_token
        if start % engine.engine.cache_config.block_size:
            return kv_migration_pb2.TransferKvResponse(reason=f"start_token {start} is not block-aligned")
        lease = engine.engine.lease_kv(request.request_id, tokens, allow_prefix_cache=request.allow_prefix_cache)
        if lease is None:
            return kv_migration_pb2.TransferKvResponse(reason="no KV held here for this request's tokens")
        if lease.num_tokens <= start:
            engine.engine.release_blocks(lease.block_ids)
            reason = f"the peer already holds {start} tokens; {lease.num_tokens} held here"
            return kv_migration_pb2.TransferKvResponse(reason=reason)
        try:
            channel = await _in_thread(
                shm_send,
                engine.engine.kv_cache.layers,
                list(lease.block_ids[start // engine.engine.cache_config.block_size :]),
                num_tokens=lease.num_tokens - start,
                pool=self.shm_pool,
                discard=lambda ch: ch.__exit__(None, None, None),
            )
        finally:
            engine.engine.release_blocks(lease.block_ids)
        transfer_id = secrets.token_hex(12)
        self._outgoing[transfer_id] = _Outgoing(channel, rank, request.request_id, request.keep_pin)
        counters = self.counters[rank]
        counters.transfers_out += 1
        counters.bytes_out += channel.transfer.nbytes
        return kv_migration_pb2.TransferKvResponse(
            num_tokens=lease.num_tokens,
            transfer_id=transfer_id,
            transfer_json=json.dumps(channel.transfer.to_dict()),
            source=lease.source,
            nbytes=channel.transfer.nbytes,
            block_ids=lease.block_ids,
        )

    async def ReleaseKv(
        self, request: kv_migration_pb2.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> kv_migration_pb2.ReleaseKvResponse:
        out = self._outgoing.pop(request.transfer_id, None)
        if out is None:
            return kv_migration_pb2.ReleaseKvResponse(released=False)
        await self._end([out], read=True)
        return kv_migration_pb2.ReleaseKvResponse(released=True)

    async def GetKvMigrationStats(
        self, request: kv_migration_pb2.GetKvMigrationStatsRequest, context: grpc.aio.ServicerContext
    ) -> kv_migration_pb2.KvMigrationStats:
        rank = request.data_parallel_rank
        engine = await self._rank(rank, context)
        c = self.counters[rank]
        return kv_migration_pb2.KvMigrationStats(
            transfers_out=c.transfers_out,
            bytes_out=c.bytes_out,
            transfers_in=c.transfers_in,
            bytes_in=c.bytes_in,
            tokens_in=c.tokens_in,
            transfer_seconds_in=c.transfer_seconds_in,
            fallbacks=c.fallbacks,
            prompt_tokens_computed=engine.engine.num_prompt_tokens_computed,
            pinned_requests=engine.engine.num_pinned,
        )

    def _close(self, out: _Outgoing, *, read: bool = False) -> None:
        """End an outgoing transfer; `read`: the peer said it has copied everything out (a pooled segment can
        then serve the next transfer; otherwise it is retired, as the peer may still be reading)."""
        with contextlib.suppress(Exception):
            if read and out.channel.transfer.pooled:
                out.channel.recycle()
            else:
                out.channel.__exit__(None, None, None)  # unlinks the name (if the peer did not) and unmaps
        if not out.keep_pin:
            self.engines[out.rank].engine.unpin_kv(out.request_id)

    def _expired(self) -> list[_Outgoing]:
        """Take the transfers no peer acknowledged within the TTL out of the table."""
        deadline = time.monotonic() - UNACKED_TRANSFER_TTL_S
        return [self._outgoing.pop(t) for t in [t for t, o in self._outgoing.items() if o.created < deadline]]

    async def _end(self, outs: list[_Outgoing], *, read: bool) -> None:
        """Close transfers off the event loop (unmapping and freeing a large segment takes a while)."""

        def close_all() -> None:
            for out in outs:
                self._close(out, read=read)

        if outs:
            await asyncio.to_thread(close_all)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for out in self._outgoing.values():
            self._close(out)
        self._outgoing.clear()
        if self.shm_pool is not None:
            self.shm_pool.close()


def remove_stale_segments(shm_dir: Path = Path("/dev/shm")) -> int:
    """Unlink KV segments whose creating process is gone (names are `psrl-kv-<pid>-<random>`, see
    psrl.kv.channels.new_segment_name): a source killed mid-transfer leaves its segments behind."""
    removed = 0
    for path in shm_dir.glob("psrl-kv-*-*") if shm_dir.is_dir() else ():
        pid = path.name.split("-")[2]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            path.unlink()
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class KvTransferParams:
    """`kv_transfer_params_json` of a GenerateRequest: where the request's KV is and how to fetch it."""

    source_target: str  # host:port of the source replica's gRPC server
    source_dp_rank: int
    request_id: str  # the request's id on the source
    num_tokens: int  # tokens whose KV the source should hold (0: as many as it has)
    mode: TransferMode = "async"
    timeout_ms: int = 5000

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KvTransferParams:
        """From the JSON object (the servicer parses the JSON: vLLM's rules for the field come first)."""
        try:
            source = data["source"]
            params = cls(
                source_target=str(source["target"]),
                source_dp_rank=int(source.get("dp_rank", 0)),
                request_id=str(data["request_id"]),
                num_tokens=int(data.get("num_tokens", 0)),
                mode=data.get("mode", "async"),
                timeout_ms=int(data.get("timeout_ms", 5000)),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"Invalid kv_transfer_params_json: {e}") from None
        if params.mode not in TRANSFER_MODES:
            raise ValueError(f"Invalid kv_transfer_params_json: mode {params.mode!r} is not one of {TRANSFER_MODES}")
        if params.timeout_ms <= 0 or params.num_tokens < 0:
            raise ValueError("Invalid kv_transfer_params_json: timeout_ms must be > 0 and num_tokens >= 0")
        return params


_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARD = frozenset({"", "0.0.0.0", "::"})


def _host_port(target: str) -> tuple[str, int | None]:
    host, _, port = target.rpartition(":")
    try:
        return host.strip("[]").lower(), int(port)
    except ValueError:
        return target.lower(), None


def same_server(bound: str) -> Callable[[str], bool]:
    """A test of whether a `host:port` target names the server bound at `bound` (its own `host:port`): the same
    port, and a host the bound address answers on: itself; any loopback name for a loopback address; for a
    wildcard address, also this machine's name and addresses. (A specific address answers on nothing else:
    another process may hold the same port on another address.)"""
    bound_host, bound_port = _host_port(bound)
    hosts = {bound_host}
    if bound_host in _LOOPBACK or bound_host in _WILDCARD:
        hosts |= _LOOPBACK
    if bound_host in _WILDCARD:
        names = {socket.gethostname(), socket.getfqdn()}
        with contextlib.suppress(OSError):
            names |= {str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)}
        hosts |= _WILDCARD | {n.lower() for n in names}

    def test(target: str) -> bool:
        host, port = _host_port(target)
        return port is not None and port == bound_port and host in hosts

    return test


def _wanted_tokens(prompt: Sequence[int], params: KvTransferParams) -> int:
    """How much of the prompt's KV to take: what the params name (all when 0), never the last prompt token
    (it is always computed here: its logits are needed)."""
    limit = len(prompt) - 1
    return min(params.num_tokens, limit) if params.num_tokens else limit


class KvPuller:
    """The destination side: fetch a request's KV from its source into reserved blocks of one engine."""

    def __init__(self, counters: list[MigrationCounters], self_target: str, *, shm_mappings_bytes: int = 0) -> None:
        self._counters = counters
        self._is_self = same_server(self_target)  # a source on this replica's own server needs no transfer
        # Pooled source segments kept mapped between transfers (0: map each one for its transfer only).
        self.shm_mappings = ShmMappings(shm_mappings_bytes) if shm_mappings_bytes > 0 else None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._releases: set[asyncio.Task[None]] = set()

    def _stub(self, target: str) -> kv_migration_pb2_grpc.KvMigrationStub:
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = grpc.aio.insecure_channel(
                target, options=[("grpc.max_receive_message_length", 64 << 20)]
            )
        return kv_migration_pb2_grpc.KvMigrationStub(channel)

    async def pull(
        self, engine: AsyncEngine, rank: int, prompt: Sequence[int], params: KvTransferParams
    ) -> PreloadedKV | None:
        """The KV of the longest prefix of `prompt` the source holds, in fresh blocks of `engine`; None (a
        fallback to recompute, counted) when nothing could be moved within the timeout."""
        counters = self._counters[rank]
        start = time.perf_counter()
        if self._is_self(params.source_target) and params.source_dp_rank == rank:
            # Back on the engine that pinned it: take the pinned blocks over, no copy.
            want = _wanted_tokens(prompt, params)
            kv = engine.engine.adopt_pin(params.request_id, prompt, want) if want > 0 else None
            if kv is None:
                counters.fallbacks += 1
            return kv
        try:
            pulled = await asyncio.wait_for(self._pull(engine, prompt, params), params.timeout_ms / 1000.0)
        except Exception as e:  # any failure (timeout, source gone, channel, no room) only costs a recompute
            logger.warning(
                "KV pull for %s from %s failed, recomputing: %s: %s",
                params.request_id,
                params.source_target,
                type(e).__name__,
                e,
            )
            pulled = None
        if pulled is None:
            counters.fallbacks += 1
            return None
        kv, moved, nbytes = pulled
        if moved:
            counters.transfers_in += 1
            counters.tokens_in += moved
            counters.bytes_in += nbytes
            counters.transfer_seconds_in += time.perf_counter() - start
        return kv

    async def _pull(
        self, engine: AsyncEngine, prompt: Sequence[int], params: KvTransferParams
    ) -> tuple[PreloadedKV, int, int] | None:
        """(the request's KV, tokens moved in, bytes moved) or None when the source has nothing for it."""
        want = _wanted_tokens(prompt, params)
        if want <= 0:
            return None
        # What this engine's prefix cache already holds of the prompt (e.g. the prompt a group of samples
        # shares) is not moved: only [start, n) comes over.
        local = engine.engine.lease_cached_prefix(prompt[:want])
        held = list(local.block_ids) if local is not None else []
        start = local.num_tokens if local is not None else 0
        stub = self._stub(params.source_target)
        if start >= want:
            self._background(
                stub.UnpinKv,
                kv_migration_pb2.UnpinKvRequest(request_id=params.request_id, data_parallel_rank=params.source_dp_rank),
            )
            return PreloadedKV(tuple(held), start, tuple(prompt[:start])), 0, 0
        reserved: list[int] = []
        transfer_id = ""
        try:
            reply = await stub.TransferKv(
                kv_migration_pb2.TransferKvRequest(
                    request_id=params.request_id,
                    data_parallel_rank=params.source_dp_rank,
                    token_ids=prompt,
                    max_tokens=want,
                    channel="shm",
                    layout_json=json.dumps(layout_of(engine).to_dict()),
                    allow_prefix_cache=params.mode != "pin_sync",
                    keep_pin=False,
                    start_token=start,
                )
            )
            transfer_id = reply.transfer_id
            if reply.num_tokens == 0:
                logger.info("KV pull for %s: nothing to move (%s)", params.request_id, reply.reason)
                engine.engine.release_blocks(held)
                return None
            n = reply.num_tokens
            if not start < n <= want:
                raise ValueError(f"the source offered KV up to token {n}; asked for ({start}, {want}]")
            reserved = engine.engine.reserve_blocks(n - start)
            table = held + reserved
            block_size = engine.engine.cache_config.block_size
            plan = plan_transfer(list(reply.block_ids), table, num_tokens=n, block_size=block_size, start=start)
            transfer = ShmTransfer.from_dict(json.loads(reply.transfer_json))
            await _in_thread(
                shm_receive, transfer, engine.engine.kv_cache.layers, plan.dst_block_ids, mappings=self.shm_mappings
            )
        except BaseException:
            engine.engine.release_blocks(held + reserved)
            raise
        finally:
            if transfer_id:
                self._background(stub.ReleaseKv, kv_migration_pb2.ReleaseKvRequest(transfer_id=transfer_id))
        return PreloadedKV(tuple(table), n, tuple(prompt[:n])), n - start, transfer.nbytes

    def _background(self, rpc: Any, request: Any) -> None:
        """Send an acknowledgement (ReleaseKv, UnpinKv) without waiting: the request need not wait for the
        source's teardown, and one that never arrives is covered by the source's TTLs."""

        async def send() -> None:
            try:
                await rpc(request, timeout=10)
            except grpc.RpcError as e:
                logger.info("%s to the KV source failed (it frees the KV on its own): %s", type(request).__name__, e)

        task = asyncio.create_task(send())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def close(self) -> None:
        if self._releases:
            await asyncio.wait(self._releases, timeout=5)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        if self.shm_mappings is not None:
            self.shm_mappings.close()

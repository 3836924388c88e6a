"""KV migration between replicas: the source's `psrl.kv.KvMigration` service and the destination's pull of a
looped-back request's KV (driven by `kv_transfer_params_json` in its GenerateRequest).

Both engines share it: the service serves whatever a `KvHolder` holds (the reference engine's pinned blocks and
prefix cache, `EngineKvHolder`; the vLLM connector's pins, psrl/worker/vllm_kv.py), and every destination asks
its source through one `KvSourceClient` and takes what `tokens_to_take` allows.

The destination pulls: it keeps what its own prefix cache holds of the prompt, and TransferKv asks the source
to gather the rest of the longest prefix of the destination's prompt that it holds (the request's pin from the
sync abort, or with no pin and when allowed, full blocks of its prefix cache) straight into a POSIX
shared-memory segment; the destination reserves blocks, scatters the segment into them (planned with
psrl.kv.plan_transfer), acknowledges with ReleaseKv, and admits the request with that KV (PreloadedKV), so
only the last prompt token is prefilled. Any failure (source gone, timeout, nothing held, layout mismatch, no
room) falls back to recompute: slower, never wrong.

The channel: the destination sends its node id and device kind, and the source picks the channel from both
ends (psrl.kv.choose_channel). Shared memory is the only one served yet: a pair that needs CUDA IPC or NCCL, or
two nodes with a CPU end (CPU KV does not cross hosts), gets a reason instead, and the destination recomputes.
A peer that sends no node id (one from before node ids) is taken to be on this node, as every peer was then.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import reprlib
import secrets
import socket
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc

from psrl._proto import kv_migration_pb2, kv_migration_pb2_grpc
from psrl.engine import AsyncEngine, InvalidRequestError, KvSource, PreloadedKV
from psrl.kv import (
    ArrayLike,
    DeviceKind,
    KVCacheSpec,
    KvChannel,
    KvEnd,
    LayoutError,
    check_compatible,
    choose_channel,
    device_kind,
    joining_channels,
    plan_transfer,
)
from psrl.kv.channels import ShmChannel, ShmMappings, ShmPool, ShmTransfer, shm_receive, shm_send
from psrl.replica_auth import token_interceptors
from psrl.serving.json_body import JsonBodyError, loads_bounded
from psrl.worker.config import WILDCARD_HOSTS

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TransferMode(enum.StrEnum):
    """When the destination loads migrated KV: kv_transfer_params' "mode" (the values are the wire form)."""

    ASYNC = "async"  # beside the steps, the request waiting for it (vLLM's asynchronous load)
    SYNC = "sync"  # before the step's forward
    PIN_SYNC = "pin_sync"  # as sync, served from the source's pin only (not its prefix cache)


# A gathered segment the peer never acknowledged is freed after this long (swept every quarter of it).
UNACKED_TRANSFER_TTL_S = 60.0
# The channels this replica's KvMigration serves (CUDA IPC and NCCL are not served yet: such a pair recomputes).
SERVED_CHANNELS = frozenset({KvChannel.SHM})


_layouts: weakref.WeakKeyDictionary[AsyncEngine, KVCacheSpec] = weakref.WeakKeyDictionary()


def layout_of(engine: AsyncEngine) -> KVCacheSpec:
    """What two replicas must agree on to exchange blocks (described once per engine: its cache never changes)."""
    layout = _layouts.get(engine)
    if layout is None:
        layout = _layouts[engine] = KVCacheSpec.describe(engine.engine.kv_cache.layers)
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


@dataclass(frozen=True)
class HeldKv:
    """KV a source lends out for one transfer: the first `num_tokens` tokens asked for have their K/V in
    `block_ids` of `layers` (token order, from token 0); `release` ends the loan."""

    num_tokens: int
    block_ids: tuple[int, ...]
    source: KvSource
    layers: Sequence[ArrayLike]  # per-layer caches as psrl.kv.gather_blocks takes them
    release: Callable[[], None]


class KvHolder(Protocol):
    """Where a replica's source side finds KV, over its dp ranks."""

    @property
    def num_ranks(self) -> int: ...

    def layout(self, rank: int) -> KVCacheSpec: ...

    def block_size(self, rank: int) -> int: ...

    def device(self, rank: int) -> DeviceKind:
        """Where this rank's KV cache is (the channel to a peer depends on it)."""
        ...

    def hold(self, rank: int, request_id: str, tokens: Sequence[int], *, allow_prefix_cache: bool) -> HeldKv | None:
        """The longest prefix of `tokens` held for `request_id` (its pin; with `allow_prefix_cache` and no pin,
        full blocks of the prefix cache), lent until `release`; None when nothing is held."""
        ...

    def pin(self, rank: int, request_id: str, ttl_s: float) -> int:
        """Pin a live request's computed KV; the tokens pinned. InvalidRequestError: not running here;
        NotImplementedError: this engine pins only when a request ends."""
        ...

    def unpin(self, rank: int, request_id: str) -> bool: ...

    def prompt_tokens_computed(self, rank: int) -> int: ...

    def num_pinned(self, rank: int) -> int: ...


class EngineKvHolder:
    """The reference engines' KV: pins and prefix cache in their own block pools."""

    def __init__(self, engines: list[AsyncEngine]) -> None:
        self.engines = engines

    @property
    def num_ranks(self) -> int:
        return len(self.engines)

    def layout(self, rank: int) -> KVCacheSpec:
        return layout_of(self.engines[rank])

    def block_size(self, rank: int) -> int:
        return self.engines[rank].engine.cache_config.block_size

    def device(self, rank: int) -> DeviceKind:
        return device_kind(self.engines[rank].engine.kv_cache.layers[0])

    def hold(self, rank: int, request_id: str, tokens: Sequence[int], *, allow_prefix_cache: bool) -> HeldKv | None:
        engine = self.engines[rank].engine
        lease = engine.lease_kv(request_id, tokens, allow_prefix_cache=allow_prefix_cache)
        if lease is None:
            return None
        ids = lease.block_ids
        return HeldKv(lease.num_tokens, ids, lease.source, engine.kv_cache.layers, lambda: engine.release_blocks(ids))

    def pin(self, rank: int, request_id: str, ttl_s: float) -> int:
        return self.engines[rank].engine.pin_kv(request_id, ttl_s)

    def unpin(self, rank: int, request_id: str) -> bool:
        return self.engines[rank].engine.unpin_kv(request_id)

    def prompt_tokens_computed(self, rank: int) -> int:
        return self.engines[rank].engine.num_prompt_tokens_computed

    def num_pinned(self, rank: int) -> int:
        return self.engines[rank].engine.num_pinned


class KvMigrationServicer(kv_migration_pb2_grpc.KvMigrationServicer):
    """The source side, one instance per replica (on node `node_id`) over what its `KvHolder` holds; also holds
    every rank's counters (the destination side adds to them)."""

    def __init__(self, holder: KvHolder, *, node_id: str, shm_pool_bytes: int = 0) -> None:
        self.holder = holder
        self.node_id = node_id
        self.counters = [MigrationCounters() for _ in range(holder.num_ranks)]
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

    async def _rank(self, rank: int, context: grpc.aio.ServicerContext) -> int:
        if not 0 <= rank < self.holder.num_ranks:
            message = f"data_parallel_rank {rank} is out of range for dp_size {self.holder.num_ranks}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        return rank

    async def PinKv(
        self, request: kv_migration_pb2.PinKvRequest, context: grpc.aio.ServicerContext
    ) -> kv_migration_pb2.PinKvResponse:
        rank = await self._rank(request.data_parallel_rank, context)
        try:
            n = self.holder.pin(rank, request.request_id, request.ttl_ms / 1000.0)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except NotImplementedError as e:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(e))
        return kv_migration_pb2.PinKvResponse(num_tokens=n)

    async def UnpinKv(
        self, request: kv_migration_pb2.UnpinKvRequest, context: grpc.aio.ServicerContext
    ) -> kv_migration_pb2.UnpinKvResponse:
        rank = await self._rank(request.data_parallel_rank, context)
        return kv_migration_pb2.UnpinKvResponse(unpinned=self.holder.unpin(rank, request.request_id))

    async def TransferKv(
        self, request: kv_migration_pb2.TransferKvRequest, context: grpc.aio.ServicerContext
    ) -> kv_migration_pb2.TransferKvResponse:
        rank = await self._rank(request.data_parallel_rank, context)
        await self._end(self._expired(), read=False)
        refused = self._channel_refusal(rank, request)
        if refused is not None:
            return kv_migration_pb2.TransferKvResponse(reason=refused)
        if request.layout_json:
            try:
                peer_layout = loads_bounded(request.layout_json)
            except JsonBodyError as e:
                return kv_migration_pb2.TransferKvResponse(reason=f"layout mismatch: bad layout_json: {e.detail}")
            try:
                check_compatible(self.holder.layout(rank), peer_layout)
            except (ValueError, LayoutError) as e:
                return kv_migration_pb2.TransferKvResponse(reason=f"layout mismatch: {e}")
        tokens = list(request.token_ids)[: request.max_tokens or None]
        start = request.start_token
        block_size = self.holder.block_size(rank)
        if start % block_size:
            return kv_migration_pb2.TransferKvResponse(reason=f"start_token {start} is not block-aligned")
        held = self.holder.hold(rank, request.request_id, tokens, allow_prefix_cache=request.allow_prefix_cache)
        if held is None:
            return kv_migration_pb2.TransferKvResponse(reason="no KV held here for this request's tokens")
        try:
            if held.num_tokens <= start:
                reason = f"the peer already holds {start} tokens; {held.num_tokens} held here"
                return kv_migration_pb2.TransferKvResponse(reason=reason)
            channel = await _in_thread(
                shm_send,
                held.layers,
                list(held.block_ids[start // block_size :]),
                num_tokens=held.num_tokens - start,
                pool=self.shm_pool,
                discard=lambda ch: ch.__exit__(None, None, None),
            )
        finally:
            held.release()
        transfer_id = secrets.token_hex(12)
        self._outgoing[transfer_id] = _Outgoing(channel, rank, request.request_id, request.keep_pin)
        counters = self.counters[rank]
        counters.transfers_out += 1
        counters.bytes_out += channel.transfer.nbytes
        return kv_migration_pb2.TransferKvResponse(
            num_tokens=held.num_tokens,
            transfer_id=transfer_id,
            transfer_json=json.dumps(channel.transfer.to_dict()),
            source=held.source,
            nbytes=channel.transfer.nbytes,
            block_ids=held.block_ids,
        )

    def _channel_refusal(self, rank: int, request: kv_migration_pb2.TransferKvRequest) -> str | None:
        """Why no channel this replica serves joins it to the peer (None: shared memory does). The peer's node
        id and device pick the channel; a peer that names none is on this node and asks for what it names."""
        if not request.node_id:  # a peer from before node ids: on this node, as every peer was then
            channel = request.channel or KvChannel.SHM
            return None if channel in SERVED_CHANNELS else f"channel {channel} is not served by this replica yet"
        try:
            peer = KvEnd(request.node_id, DeviceKind(request.device))
        except ValueError:
            return f"unknown device kind {request.device!r}"
        here = KvEnd(self.node_id, self.holder.device(rank))
        joining = joining_channels(here, peer)
        if not joining:
            return (
                f"CPU KV does not cross hosts: the source is on node {here.node_id!r} ({here.device}), "
                f"the destination on node {peer.node_id!r} ({peer.device})"
            )
        chosen = choose_channel(here, peer, SERVED_CHANNELS)
        if chosen is None:
            return f"channel {joining[0]} is not served by this replica yet"
        if request.channel and request.channel != chosen:
            return f"channel {request.channel!r} asked for; {chosen} joins these two ends"
        return None

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
        rank = await self._rank(request.data_parallel_rank, context)
        c = self.counters[rank]
        return kv_migration_pb2.KvMigrationStats(
            transfers_out=c.transfers_out,
            bytes_out=c.bytes_out,
            transfers_in=c.transfers_in,
            bytes_in=c.bytes_in,
            tokens_in=c.tokens_in,
            transfer_seconds_in=c.transfer_seconds_in,
            fallbacks=c.fallbacks,
            prompt_tokens_computed=self.holder.prompt_tokens_computed(rank),
            pinned_requests=self.holder.num_pinned(rank),
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
            self.holder.unpin(out.rank, out.request_id)

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


# Bounds of kv_transfer_params' numbers: a rank and a timeout as gRPC carries them (int32), a token count as
# our protos do (uint32). Past them a value is a client's mistake, refused before it reaches a proto or a clock.
_INT32_MAX = 2**31 - 1
_UINT32_MAX = 2**32 - 1


class KvTransferParamsError(ValueError):
    """A kv_transfer_params_json we do not accept; the message says why, after vLLM's prefix for the field."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"Invalid kv_transfer_params_json: {problem}")


def kv_transfer_params_object(text: str) -> dict[str, Any]:
    """The JSON object a GenerateRequest's `kv_transfer_params_json` holds (vLLM's rule: a field that is present
    holds an object), parsed within psrl.serving's bounds (nesting, integer digits). KvTransferParamsError
    otherwise, in vLLM's words where vLLM has them."""
    try:
        data = loads_bounded(text)
    except JsonBodyError as e:
        raise KvTransferParamsError(e.detail) from None
    if not isinstance(data, dict):
        raise KvTransferParamsError("kv_transfer_params_json must be a JSON object")
    return data


def _integer(data: dict[str, Any], key: str, default: int, low: int, high: int, name: str = "") -> int:
    """`data[key]` (else `default`) as an int in [low, high]: a JSON integer, or a float with an integral value
    (5000.0); never a bool, a string, inf or nan."""
    given = data.get(key, default)
    value = int(given) if isinstance(given, float) and given.is_integer() else given
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise KvTransferParamsError(f"{name or key} must be an integer in [{low}, {high}], got {reprlib.repr(given)}")
    return value


@dataclass(frozen=True)
class KvTransferParams:
    """`kv_transfer_params_json` of a GenerateRequest: where the request's KV is and how to fetch it."""

    source_target: str  # host:port of the source replica's gRPC server
    source_dp_rank: int
    request_id: str  # the request's id on the source
    num_tokens: int  # tokens whose KV the source should hold (0: as many as it has)
    mode: TransferMode = TransferMode.ASYNC
    timeout_ms: int = 5000

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KvTransferParams:
        """From the JSON object (the servicer parses the JSON: vLLM's rules for the field come first), its
        numbers checked against their bounds; KvTransferParamsError (a ValueError) names what is wrong."""
        source = data.get("source")
        if not isinstance(source, dict) or "target" not in source:
            raise KvTransferParamsError(f"source must be an object with a target, got {reprlib.repr(source)}")
        if "request_id" not in data:
            raise KvTransferParamsError("request_id is required")
        try:
            mode = TransferMode(data.get("mode", TransferMode.ASYNC))
        except ValueError:
            values = tuple(m.value for m in TransferMode)
            raise KvTransferParamsError(f"mode {reprlib.repr(data['mode'])} is not one of {values}") from None
        return cls(
            source_target=str(source["target"]),
            source_dp_rank=_integer(source, "dp_rank", 0, 0, _INT32_MAX, "source.dp_rank"),
            request_id=str(data["request_id"]),
            num_tokens=_integer(data, "num_tokens", 0, 0, _UINT32_MAX),
            mode=mode,
            timeout_ms=_integer(data, "timeout_ms", 5000, 1, _INT32_MAX),
        )


_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def _host_port(target: str) -> tuple[str, int | None]:
    host, _, port = target.rpartition(":")
    try:
        return host.strip("[]").lower(), int(port)
    except ValueError:
        return target.lower(), None


def same_server(bound: str, advertised: str | None = None) -> Callable[[str], bool]:
    """A test of whether a `host:port` target names the server bound at `bound` (its own `host:port`) and
    registered as `advertised` (`host:port`, --advertise-host): the same port, and a host the bound address
    answers on: itself; any loopback name for a loopback address; for a wildcard address, also this machine's
    name and addresses; and the advertised host. (A specific address answers on nothing else: another process
    may hold the same port on another address.)"""
    bound_host, bound_port = _host_port(bound)
    hosts = {bound_host}
    if advertised is not None:
        hosts.add(_host_port(advertised)[0])
    if bound_host in _LOOPBACK or bound_host in WILDCARD_HOSTS:
        hosts |= _LOOPBACK
    if bound_host in WILDCARD_HOSTS:
        names = {socket.gethostname(), socket.getfqdn()}
        with contextlib.suppress(OSError):
            names |= {str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)}
        hosts |= WILDCARD_HOSTS | {n.lower() for n in names}

    def test(target: str) -> bool:
        host, port = _host_port(target)
        return port is not None and port == bound_port and host in hosts

    return test


def tokens_to_take(prompt_len: int, params: KvTransferParams, *, whole_blocks_of: int = 0) -> int:
    """How much of a prompt's KV a destination takes: what the params name (all when 0), never the last prompt
    token (it is always computed there: its logits are needed); with `whole_blocks_of`, only whole blocks of
    that size (an engine whose blocks move only whole)."""
    limit = prompt_len - 1
    want = min(params.num_tokens, limit) if params.num_tokens else limit
    if whole_blocks_of:
        want -= want % whole_blocks_of
    return max(want, 0)


class KvNotOffered(LookupError):
    """The source sent no KV beyond what the destination holds; the message is the source's reason (nothing
    held, a layout mismatch, no channel served between the two ends, ...)."""


@dataclass(frozen=True)
class KvOffer:
    """A source's answer to TransferKv: tokens [start, num_tokens) gathered into a shared-memory segment, held
    until `KvSourceClient.release`."""

    num_tokens: int
    start: int
    transfer: ShmTransfer
    block_ids: tuple[int, ...]  # the source's table from token 0 (psrl.kv.plan_transfer's source side)
    transfer_id: str

    @property
    def moved(self) -> int:
        return self.num_tokens - self.start


class KvSourceClient:
    """A destination's calls to its sources' KvMigration services, shared by the reference replica's puller
    and the vLLM connector: TransferKv (what the source holds beyond what is here), then ReleaseKv or UnpinKv
    in the background (a source that never hears them frees the KV at its own TTLs). The replica's server is
    bound at `self_target` and registered as `advertised` (see `same_server`); it runs on node `node_id`, sent
    to each source, which chooses the channel from it. `token`: the replicas' shared token
    (psrl.replica_auth), sent on every call; a peer that refuses it costs a recompute."""

    def __init__(
        self, self_target: str, *, node_id: str, advertised: str | None = None, token: str | None = None
    ) -> None:
        # A source on this replica's own server needs no transfer.
        self._is_self = same_server(self_target, advertised)
        self.node_id = node_id
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._interceptors = token_interceptors(token)
        self._acks: set[asyncio.Task[None]] = set()

    def is_self(self, params: KvTransferParams, rank: int) -> bool:
        return self._is_self(params.source_target) and params.source_dp_rank == rank

    def _stub(self, target: str) -> kv_migration_pb2_grpc.KvMigrationStub:
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = grpc.aio.insecure_channel(
                target, options=[("grpc.max_receive_message_length", 64 << 20)], interceptors=self._interceptors
            )
        return kv_migration_pb2_grpc.KvMigrationStub(channel)

    async def offer(
        self,
        params: KvTransferParams,
        prompt: Sequence[int],
        *,
        start: int,
        want: int,
        layout: KVCacheSpec,
        device: DeviceKind,
    ) -> KvOffer:
        """Ask the source for the KV of prompt tokens [start, want) (fewer if it holds fewer) for a cache of
        `layout` on `device`, the source choosing the channel. KvNotOffered (its reason) when it sends nothing
        beyond `start`; raises too on a broken source or a malformed answer."""
        reply = await self._stub(params.source_target).TransferKv(
            kv_migration_pb2.TransferKvRequest(
                request_id=params.request_id,
                data_parallel_rank=params.source_dp_rank,
                token_ids=prompt,
                max_tokens=want,
                layout_json=json.dumps(layout.to_dict()),
                allow_prefix_cache=params.mode != TransferMode.PIN_SYNC,
                keep_pin=False,
                start_token=start,
                node_id=self.node_id,
                device=device,
            )
        )
        if reply.num_tokens == 0:
            raise KvNotOffered(reply.reason)
        offer = None
        try:
            n = reply.num_tokens
            if not start < n <= want:
                raise ValueError(f"the source offered KV up to token {n}; asked for ({start}, {want}]")
            transfer = ShmTransfer.from_dict(json.loads(reply.transfer_json))
            offer = KvOffer(n, start, transfer, tuple(reply.block_ids), reply.transfer_id)
        finally:
            if offer is None and reply.transfer_id:
                self._ack(params, kv_migration_pb2.ReleaseKvRequest(transfer_id=reply.transfer_id))
        return offer

    def release(self, params: KvTransferParams, offer: KvOffer) -> None:
        """Tell the source the offer's segment is read (or not wanted): it ends the pin and reuses the segment."""
        self._ack(params, kv_migration_pb2.ReleaseKvRequest(transfer_id=offer.transfer_id))

    def unpin(self, params: KvTransferParams) -> None:
        """Tell the source its pin is not needed (everything was found here)."""
        request = kv_migration_pb2.UnpinKvRequest(
            request_id=params.request_id, data_parallel_rank=params.source_dp_rank
        )
        self._ack(params, request)

    def _ack(self, params: KvTransferParams, request: Any) -> None:
        stub = self._stub(params.source_target)
        rpc = stub.ReleaseKv if isinstance(request, kv_migration_pb2.ReleaseKvRequest) else stub.UnpinKv

        async def send() -> None:
            try:
                await rpc(request, timeout=10)
            except grpc.RpcError as e:
                logger.info("%s to the KV source failed (it frees the KV on its own): %s", type(request).__name__, e)

        task = asyncio.create_task(send())
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def close(self) -> None:
        if self._acks:
            await asyncio.wait(self._acks, timeout=5)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def log_fallback(params: KvTransferParams, e: BaseException) -> None:
    logger.warning(
        "KV pull for %s from %s failed, recomputing: %s: %s",
        params.request_id,
        params.source_target,
        type(e).__name__,
        e,
    )


class KvPuller:
    """The reference replica's destination side: fetch a request's KV from its source (through `client`) into
    reserved blocks of one engine."""

    def __init__(
        self, counters: list[MigrationCounters], client: KvSourceClient, *, shm_mappings_bytes: int = 0
    ) -> None:
        self._counters = counters
        self.client = client
        # Pooled source segments kept mapped between transfers (0: map each one for its transfer only).
        self.shm_mappings = ShmMappings(shm_mappings_bytes) if shm_mappings_bytes > 0 else None

    async def pull(
        self, engine: AsyncEngine, rank: int, prompt: Sequence[int], params: KvTransferParams
    ) -> PreloadedKV | None:
        """The KV of the longest prefix of `prompt` the source holds, in fresh blocks of `engine`; None (a
        fallback to recompute, counted, its reason logged) when nothing could be moved within the timeout."""
        counters = self._counters[rank]
        start = time.perf_counter()
        if self.client.is_self(params, rank):
            # Back on the engine that pinned it: take the pinned blocks over, no copy.
            want = tokens_to_take(len(prompt), params)
            kv = engine.engine.adopt_pin(params.request_id, prompt, want) if want > 0 else None
            if kv is None:
                counters.fallbacks += 1
            return kv
        try:
            pulled = await asyncio.wait_for(self._pull(engine, prompt, params), params.timeout_ms / 1000.0)
        except Exception as e:  # any failure (timeout, source gone, channel, no room) only costs a recompute
            log_fallback(params, e)
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
        """(the request's KV, tokens moved in, bytes moved); None when it needs nothing moved, KvNotOffered when
        the source sends nothing."""
        want = tokens_to_take(len(prompt), params)
        if want <= 0:
            return None
        # What this engine's prefix cache already holds of the prompt (e.g. the prompt a group of samples
        # shares) is not moved: only [start, n) comes over.
        local = engine.engine.lease_cached_prefix(prompt[:want])
        held = list(local.block_ids) if local is not None else []
        start = local.num_tokens if local is not None else 0
        if start >= want:
            self.client.unpin(params)
            return PreloadedKV(tuple(held), start, tuple(prompt[:start])), 0, 0
        reserved: list[int] = []
        offer: KvOffer | None = None
        try:
            layers = engine.engine.kv_cache.layers
            offer = await self.client.offer(
                params, prompt, start=start, want=want, layout=layout_of(engine), device=device_kind(layers[0])
            )
            n = offer.num_tokens
            reserved = engine.engine.reserve_blocks(n - start)
            table = held + reserved
            block_size = engine.engine.cache_config.block_size
            plan = plan_transfer(list(offer.block_ids), table, num_tokens=n, block_size=block_size, start=start)
            await _in_thread(
                shm_receive,
                offer.transfer,
                engine.engine.kv_cache.layers,
                plan.dst_block_ids,
                mappings=self.shm_mappings,
            )
        except BaseException:
            engine.engine.release_blocks(held + reserved)
            raise
        finally:
            if offer is not None:
                self.client.release(params, offer)
        return PreloadedKV(tuple(table), n, tuple(prompt[:n])), n - start, offer.transfer.nbytes

    async def close(self) -> None:
        await self.client.close()
        if self.shm_mappings is not None:
            self.shm_mappings.close()

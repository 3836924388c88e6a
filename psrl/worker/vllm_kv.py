"""KV migration on vLLM replicas: `PsrlKvConnector`, a vLLM KV connector (API v1), and the replica's side of it.

vLLM runs its scheduler and, with one worker per engine (tensor parallel size 1, the only case served here),
its model worker inside the engine-core process, a child of the replica. Both roles of the connector meet in
one `_Shared` object there, which owns the KV caches' views, the pins, a private event loop thread, and a
`psrl.kv.KvMigration` server on a Unix socket (the side channel). The replica's own gRPC server forwards
KvMigration calls to that socket (`KvMigrationProxy`), so peers reach it at the replica's address, as they
reach a reference replica's.

Source. When a request ends aborted (a weight sync's abort; vLLM does not tell it from a client's abort),
`request_finished` copies the KV of its computed tokens, whole blocks only, out of vLLM's cache into a pin
buffer of ours and lets vLLM free the blocks. Keeping vLLM's own blocks instead (a delayed free) would hold a
weight sync: vLLM counts a delayed free as work, so `pause_generation` returns only once the pins are gone, and
`reset_prefix_cache` refuses while any block is held. A pin lives for `pin_ttl_s`, at most `pin_max_bytes` of
them (oldest dropped first); TransferKv serves the longest common prefix of the asked tokens that the pin
holds (vLLM's prefix cache is not offered: it lives in the scheduler, outside what a peer may read safely).

Destination. A request whose `kv_transfer_params` name a source (the router's loop-back) is held back by
`get_num_new_matched_tokens` (it answers "ask again") while the loop thread asks the source for the prompt's
KV beyond the block-aligned local prefix-cache hit, in whole blocks, never the last prompt token. The answer
decides what vLLM allocates; the worker side then scatters the segment into those blocks: before the step's
forward (`sync`, `pin_sync`), or beside the steps with the request waiting for it (`async`, vLLM's
asynchronous load). Back on its own replica a request takes its pin from memory, no transfer. Any failure
(source gone, timeout, nothing held, layout mismatch, no channel served between the two ends, a changed local
hit) loads nothing and the request is prefilled; a failed copy is reported through
`get_block_ids_with_load_errors`, so vLLM recomputes those blocks: slower, never wrong. The complete frame's
`kv_transfer_params_json` reports `{"moved_tokens": n}`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import grpc
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

from psrl._proto import kv_migration_pb2_grpc
from psrl.credentials import load_replica_token
from psrl.engine import KvSource, common_prefix
from psrl.kv import DeviceKind, KVCacheSpec, LayoutError, device_kind, gather_blocks, scatter_blocks
from psrl.kv.channels import ShmChannel, ShmMappings, ShmTransfer, shm_receive
from psrl.worker.kv_migration import (
    UNACKED_TRANSFER_TTL_S,
    HeldKv,
    KvMigrationServicer,
    KvOffer,
    KvSourceClient,
    KvTransferParams,
    MigrationCounters,
    TransferMode,
    log_fallback,
    tokens_to_take,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "PsrlKvConnector"
_RANDOM_SUFFIX = 9  # vLLM makes its internal request id `{id}-{8 random characters}`


def kv_transfer_config(
    *,
    self_target: str,
    advertised: str,
    node_id: str,
    side_channel: str,
    pin_ttl_s: float,
    shm_pool_bytes: int,
    pin_max_bytes: int,
    replica_token_file: str | None = None,
) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` that loads this connector (a replica's own server bound at `self_target`,
    registered as `advertised`, on node `node_id`).

    The replicas' token is never put in it (vLLM logs its config): the engine core reads it the way the replica
    did, from `replica_token_file` or else from $PSRL_REPLICA_TOKEN, which it inherits."""
    extra: dict[str, Any] = {
        "self_target": self_target,
        "advertised": advertised,
        "node_id": node_id,
        "side_channel": side_channel,
        "pin_ttl_s": pin_ttl_s,
        "shm_pool_bytes": shm_pool_bytes,
        "pin_max_bytes": pin_max_bytes,
    }
    if replica_token_file:
        extra["replica_token_file"] = replica_token_file
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": __name__,
        "kv_role": "kv_both",
        # A copy that fails after allocation recomputes the request's blocks (vLLM's default fails the request).
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


# ---- the replica side ------------------------------------------------------------------------------


class KvMigrationProxy(kv_migration_pb2_grpc.KvMigrationServicer):
    """The replica's KvMigration service: every call forwarded to the engine-core process's side channel.

    The replica's server checks the token (if any) before a call gets here; the side channel itself takes none:
    it is a Unix socket in a directory only the replica's user can enter (mkdtemp, mode 0700), and that user
    can read the token from the replica's environment or file anyway."""

    def __init__(self, side_channel: str) -> None:
        self._channel = grpc.aio.insecure_channel(side_channel, options=[("grpc.max_receive_message_length", 64 << 20)])
        self._stub = kv_migration_pb2_grpc.KvMigrationStub(self._channel)

    async def _forward(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        remaining = context.time_remaining()
        try:
            return await getattr(self._stub, method)(request, timeout=remaining)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "")

    async def PinKv(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._forward("PinKv", request, context)

    async def UnpinKv(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._forward("UnpinKv", request, context)

    async def TransferKv(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._forward("TransferKv", request, context)

    async def ReleaseKv(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._forward("ReleaseKv", request, context)

    async def GetKvMigrationStats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._forward("GetKvMigrationStats", request, context)

    async def close(self) -> None:
        await self._channel.close()


# ---- the KV caches ---------------------------------------------------------------------------------


def cache_views(kv_caches: Sequence[torch.Tensor], block_size: int) -> tuple[list[torch.Tensor], KVCacheSpec]:
    """vLLM's per-layer caches as psrl.kv's `[2, num_blocks, block_size, num_kv_heads, head_size]` views, and
    their layout.

    The CPU backend's `[num_blocks, num_kv_heads, block_size, 2 * head_size]` (K stored transposed beside V in
    each block) is viewed as raw block bytes, its halves as "K" and "V": a whole block moves exactly, a part of
    one would not, so its layout is "opaque". GPU caches `[2, num_blocks, ...]` (or `[num_blocks, 2, ...]`)
    are described by their strides.
    """
    first = kv_caches[0]
    if first.dim() == 4 and not first.is_cuda:
        num_blocks, heads, tokens, width = first.shape
        if tokens != block_size or width % 2 or not first.is_contiguous():
            raise LayoutError(f"unexpected vLLM CPU cache {list(first.shape)} for block size {block_size}")
        head_size = width // 2
        half = heads * tokens * head_size
        shape = (2, num_blocks, tokens, heads, head_size)
        strides = (half, 2 * half, heads * head_size, head_size, 1)
        views = [t.as_strided(shape, strides) for t in kv_caches]
        spec = KVCacheSpec(len(views), tokens, heads, head_size, str(first.dtype), "opaque")
        return views, spec
    if first.dim() == 5:
        views = [t if t.shape[0] == 2 else t.transpose(0, 1) for t in kv_caches]
        spec = KVCacheSpec.describe(views)
        if spec.block_size != block_size:
            raise LayoutError(f"the cache's blocks hold {spec.block_size} tokens; vLLM's block size is {block_size}")
        return views, spec
    raise LayoutError(f"unsupported vLLM KV cache shape {list(first.shape)}")


def _to_device_of(buffer: torch.Tensor, caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """A host buffer on the caches' device (pins and segments live in host memory; GPU caches do not)."""
    return buffer.to(caches[0].device) if caches[0].is_cuda else buffer


def _copy_blocks(
    src: Sequence[torch.Tensor], src_ids: Sequence[int], dst: Sequence[torch.Tensor], dst_ids: Sequence[int]
) -> None:
    scatter_blocks(_to_device_of(gather_blocks(src, list(src_ids)), dst), dst, list(dst_ids))


def _receive(
    transfer: ShmTransfer, caches: Sequence[torch.Tensor], ids: Sequence[int], mappings: ShmMappings | None
) -> None:
    """Scatter a peer's segment into blocks `ids` (through the device for GPU caches)."""
    if not caches[0].is_cuda:
        shm_receive(transfer, caches, list(ids), mappings=mappings)
        return
    with ShmChannel.open(transfer, mappings=mappings) as channel:
        host = cast(torch.Tensor, channel.buffer(torch.empty(0)))  # a tensor view: `like` is one
        staged = _to_device_of(host, caches)  # copied out before the unmap
    scatter_blocks(staged, caches, list(ids))


# ---- what both roles share in the engine-core process ----------------------------------------------


@dataclass
class _Pin:
    token_ids: tuple[int, ...]  # the tokens whose KV `buffer` holds (whole blocks)
    buffer: torch.Tensor  # host memory, [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]
    expires: float

    @property
    def layers(self) -> list[torch.Tensor]:
        return list(self.buffer.unbind(0))

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)


class _Shared:
    """One engine-core process's migration state; see the module docstring."""

    _by_engine: dict[str, _Shared] = {}
    _lock = threading.Lock()

    @classmethod
    def of(cls, vllm_config: VllmConfig) -> _Shared:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        with cls._lock:
            shared = cls._by_engine.get(str(transfer.engine_id))
            if shared is None:
                shared = cls._by_engine[str(transfer.engine_id)] = cls(vllm_config)
            return shared

    def __init__(self, vllm_config: VllmConfig) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        extra = transfer.kv_connector_extra_config
        if vllm_config.parallel_config.world_size > 1:
            raise ValueError(f"{CONNECTOR_NAME} serves one worker per engine (tensor and pipeline parallel size 1)")
        self.block_size = int(vllm_config.cache_config.block_size)
        self.pin_ttl_s = float(extra.get("pin_ttl_s", 30.0))
        self.pin_max_bytes = int(extra.get("pin_max_bytes", 1 << 30))
        self.side_channel = str(extra["side_channel"])
        self.client_target = str(extra["self_target"])
        self.node_id = str(extra["node_id"])
        self.shm_pool_bytes = int(extra.get("shm_pool_bytes", 0))
        self.counters = MigrationCounters()
        self.prompt_tokens_computed = 0
        self.caches: list[torch.Tensor] = []
        self.layout: KVCacheSpec | None = None
        self.mappings = ShmMappings(self.shm_pool_bytes) if self.shm_pool_bytes > 0 else None
        self._pins: OrderedDict[str, _Pin] = OrderedDict()  # by the caller's request id, oldest first
        self._pins_lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="psrl-kv", daemon=True)
        self._thread.start()
        # Its channels are made on the loop, when first used; it calls peers' public servers, so with the token.
        token = load_replica_token(extra.get("replica_token_file"))
        self.client = KvSourceClient(
            self.client_target, node_id=self.node_id, advertised=str(extra["advertised"]), token=token
        )
        self._server: grpc.aio.Server | None = None
        self._servicer: KvMigrationServicer | None = None

    def run(self, coro: Any, timeout: float | None = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def register(self, caches: list[torch.Tensor], layout: KVCacheSpec) -> None:
        """The worker's caches are known: serve the side channel."""
        self.caches, self.layout = caches, layout
        self.run(self._serve())
        logger.info("KV migration side channel at %s (%s)", self.side_channel, layout)

    async def _serve(self) -> None:
        self._servicer = KvMigrationServicer(_PinHolder(self), node_id=self.node_id, shm_pool_bytes=self.shm_pool_bytes)
        self._servicer.counters[0] = self.counters
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
        kv_migration_pb2_grpc.add_KvMigrationServicer_to_server(self._servicer, server)
        if server.add_insecure_port(self.side_channel) == 0:
            raise OSError(f"cannot bind the KV side channel {self.side_channel}")
        await server.start()
        self._servicer.start()

        async def expire() -> None:
            while True:
                await asyncio.sleep(max(self.pin_ttl_s / 4, 0.5))
                self.expire_pins()

        self._expiry = asyncio.create_task(expire())
        self._server = server

    # ---- pins ----

    def pin(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        if not self.caches or self.layout is None or self.layout.transfer_nbytes(len(block_ids)) > self.pin_max_bytes:
            return
        buffer = gather_blocks(self.caches, list(block_ids))
        if buffer.is_cuda:
            buffer = buffer.cpu()  # pins live in host memory, beside vLLM's device budget
        pin = _Pin(tuple(token_ids), buffer, time.monotonic() + self.pin_ttl_s)
        with self._pins_lock:
            self._pins.pop(request_id, None)
            self._pins[request_id] = pin
            total = sum(p.nbytes for p in self._pins.values())
            while total > self.pin_max_bytes:
                _, dropped = self._pins.popitem(last=False)
                total -= dropped.nbytes

    def expire_pins(self) -> None:
        now = time.monotonic()
        with self._pins_lock:
            for key in [k for k, p in self._pins.items() if p.expires <= now]:
                del self._pins[key]

    def find_pin(self, request_id: str) -> _Pin | None:
        self.expire_pins()
        with self._pins_lock:
            return self._pins.get(request_id)

    def take_pin(self, request_id: str) -> _Pin | None:
        self.expire_pins()
        with self._pins_lock:
            return self._pins.pop(request_id, None)

    @property
    def num_pinned(self) -> int:
        self.expire_pins()
        return len(self._pins)

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._expiry.cancel()
                await self._server.stop(grace=0.5)
                assert self._servicer is not None
                self._servicer.close()
            await self.client.close()

        if self.loop.is_running():
            with contextlib.suppress(Exception):
                self.run(stop(), timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self.mappings is not None:
            self.mappings.close()


class _PinHolder:
    """The side channel's `KvHolder`: the pins of this engine (one dp rank)."""

    num_ranks = 1

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared

    def layout(self, rank: int) -> KVCacheSpec:
        assert self.shared.layout is not None
        return self.shared.layout

    def block_size(self, rank: int) -> int:
        return self.shared.block_size

    def device(self, rank: int) -> DeviceKind:
        return device_kind(self.shared.caches[0])

    def hold(self, rank: int, request_id: str, tokens: Sequence[int], *, allow_prefix_cache: bool) -> HeldKv | None:
        pin = self.shared.find_pin(request_id)
        if pin is None:
            return None
        n = common_prefix(pin.token_ids, tokens)
        n -= n % self.shared.block_size
        if n == 0:
            return None
        return HeldKv(n, tuple(range(n // self.shared.block_size)), KvSource.PIN, pin.layers, lambda: None)

    def pin(self, rank: int, request_id: str, ttl_s: float) -> int:
        raise NotImplementedError("a vLLM replica pins a request's KV when the request is aborted, not on demand")

    def unpin(self, rank: int, request_id: str) -> bool:
        return self.shared.take_pin(request_id) is not None

    def prompt_tokens_computed(self, rank: int) -> int:
        return self.shared.prompt_tokens_computed

    def num_pinned(self, rank: int) -> int:
        return self.shared.num_pinned


# ---- the connector ---------------------------------------------------------------------------------


@dataclass
class _Outcome:
    """What the worker side found when it copied a load in (both roles hold it: they share the process)."""

    done: bool = False
    failed: bool = False


@dataclass(frozen=True)
class _LoadSpec:
    """One request's load, from the scheduler side to the worker side."""

    request_id: str
    load_async: bool
    first_block: int  # index in the request's table of the first loaded block (the local hit's end)
    dst_block_ids: tuple[int, ...]
    offer: KvOffer | None  # from a peer, through shared memory
    pin: _Pin | None  # back on its own replica: its pin (blocks from `first_block` on are copied)
    params: KvTransferParams
    started: float
    outcome: _Outcome


@dataclass
class _Meta(KVConnectorMetadata):
    loads: list[_LoadSpec] = field(default_factory=list)


@dataclass
class _Load:
    """A destination request's migration, as the scheduler side tracks it."""

    params: KvTransferParams
    start: int  # tokens of the block-aligned local prefix-cache hit when the source was asked
    started: float
    probe: concurrent.futures.Future[KvOffer] | None = None
    offer: KvOffer | None = None
    pin: _Pin | None = None  # back on its own replica: its pin
    num_tokens: int = 0  # the end of the range to load (0: nothing to load)
    not_prefilled: int = 0  # what the complete frame reports as moved_tokens
    decided: bool = False
    outcome: _Outcome | None = None  # set once the load is handed to the worker


def _caller_id(request_id: str) -> str:
    """The id the router knows a request by (vLLM's internal id without its random suffix)."""
    from vllm import envs

    if envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION or len(request_id) <= _RANDOM_SUFFIX:
        return request_id
    return request_id[:-_RANDOM_SUFFIX] if request_id[-_RANDOM_SUFFIX] == "-" else request_id


def _block_table(block_ids: Any) -> list[int]:
    """The first KV cache group's block ids (vLLM passes one list, or one per group)."""
    if block_ids and isinstance(block_ids[0], list | tuple):
        return list(block_ids[0])
    return list(block_ids)


class PsrlKvConnector(KVConnectorBase_V1):
    """See the module docstring; the scheduler role and the worker role are two instances sharing `_Shared`."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.shared = _Shared.of(vllm_config)
        self.block_size = self.shared.block_size
        # scheduler role
        self._loads: dict[str, _Load] = {}
        self._to_start: list[_LoadSpec] = []
        # worker role
        self._async: dict[str, concurrent.futures.Future[None]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="psrl-kv-load")
        self._load_errors: set[int] = set()
        self._errors_lock = threading.Lock()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed off when a request finishes: a pin is a copy made at once

    # ---- scheduler side: destination ----

    def _params(self, request: Request) -> KvTransferParams | None:
        data = request.kv_transfer_params
        if not data or "source" not in data or request.skip_reading_prefix_cache:
            return None
        try:
            return KvTransferParams.from_dict(data)
        except ValueError as e:
            logger.warning("request %s: %s; prefilling it", request.request_id, e)
            return None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        load = self._loads.get(request.request_id)
        if load is None:
            params = self._params(request)
            if params is None or self.shared.layout is None:
                return 0, False
            load = self._loads[request.request_id] = self._begin(request, params, num_computed_tokens)
        if load.outcome is not None:
            return 0, False  # loaded once already: a preempted request recomputes what it lost
        if not load.decided:
            assert load.probe is not None
            if not load.probe.done():
                if time.monotonic() - load.started < load.params.timeout_ms / 1000.0:
                    return None, False  # asked again next step
                if load.probe.cancel():
                    self._fall_back(load, TimeoutError(f"no answer in {load.params.timeout_ms} ms"))
                    return 0, False
            self._answered(load)
        if load.num_tokens and num_computed_tokens != load.start:
            # The local hit changed while the source was asked: the segment starts elsewhere.
            self._fall_back(load, ValueError(f"local prefix hit moved from {load.start} to {num_computed_tokens}"))
        elif load.offer is not None and time.monotonic() - load.started > UNACKED_TRANSFER_TTL_S / 2:
            # Waited for room so long that the source may give the segment up before it is read.
            self._fall_back(load, TimeoutError("the answered KV waited too long for free blocks"))
        if not load.num_tokens:
            return 0, False
        return load.num_tokens - num_computed_tokens, load.params.mode == TransferMode.ASYNC

    def _begin(self, request: Request, params: KvTransferParams, num_computed: int) -> _Load:
        prompt = list(request.prompt_token_ids or ())
        want = tokens_to_take(len(prompt), params, whole_blocks_of=self.block_size)
        load = _Load(params, num_computed, time.monotonic())
        is_self = self.shared.client.is_self(params, 0)
        if want <= num_computed:  # what it needs is here already (e.g. its own blocks in the prefix cache)
            load.decided = True
            load.not_prefilled = num_computed
            if is_self:
                self.shared.take_pin(params.request_id)
            else:
                self.shared.loop.call_soon_threadsafe(self.shared.client.unpin, params)
            return load
        if is_self:
            load.decided = True
            load.pin = self.shared.take_pin(params.request_id)
            n = common_prefix(load.pin.token_ids, prompt[:want]) if load.pin is not None else 0
            n -= n % self.block_size
            if n > num_computed:
                load.num_tokens = n
            else:
                self._fall_back(load, LookupError("no pin of its own covers more than the local hit"))
            return load
        assert self.shared.layout is not None
        device = device_kind(self.shared.caches[0])
        offer = self.shared.client.offer(
            params, prompt, start=num_computed, want=want, layout=self.shared.layout, device=device
        )
        load.probe = self.shared.submit(offer)
        return load

    def _answered(self, load: _Load) -> None:
        load.decided = True
        assert load.probe is not None
        try:
            offer = load.probe.result()
        except Exception as e:  # KvNotOffered (the source's reason) among them
            self._fall_back(load, e)
            return
        load.offer = offer
        if offer.num_tokens % self.block_size:
            self._fall_back(load, ValueError(f"the source offered {offer.num_tokens} tokens, not whole blocks"))
            return
        load.num_tokens = offer.num_tokens

    def _fall_back(self, load: _Load, e: BaseException) -> None:
        load.decided = True
        log_fallback(load.params, e)
        self.shared.counters.fallbacks += 1
        load.num_tokens = 0
        load.pin = None
        self._release(load)

    def _release(self, load: _Load) -> None:
        if load.offer is not None:
            self.shared.loop.call_soon_threadsafe(self.shared.client.release, load.params, load.offer)
            load.offer = None

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        load = self._loads.get(request.request_id)
        if load is None or load.outcome is not None or not load.num_tokens:
            return
        if num_external_tokens == 0:  # vLLM took none of it after all
            load.num_tokens, load.pin = 0, None
            self._release(load)
            return
        table = blocks.get_block_ids()[0]
        first = load.start // self.block_size
        dst = tuple(table[first : first + num_external_tokens // self.block_size])
        load.outcome = _Outcome()
        load.not_prefilled = load.num_tokens
        spec = _LoadSpec(
            request.request_id,
            load.params.mode == TransferMode.ASYNC,
            first,
            dst,
            load.offer,
            load.pin,
            load.params,
            load.started,
            load.outcome,
        )
        load.offer = load.pin = None  # the worker releases the offer once read
        self._to_start.append(spec)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            self.shared.prompt_tokens_computed += max(len(new.prompt_token_ids or ()) - new.num_computed_tokens, 0)
        meta, self._to_start = _Meta(self._to_start), []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        load = self._loads.pop(request.request_id, None)
        reply = None
        valid = request.num_computed_tokens - request.num_in_flight_tokens  # KV written by finished steps
        if load is not None:
            if load.probe is not None and not load.decided and not load.probe.cancel():
                with contextlib.suppress(Exception):
                    load.offer = load.probe.result(timeout=0)
            self._release(load)
            outcome = load.outcome
            if outcome is not None and (outcome.failed or not outcome.done):
                valid = min(valid, load.start)  # its loaded blocks are not (all) written
            moved = 0 if outcome is not None and outcome.failed else load.not_prefilled
            reply = {"moved_tokens": moved}
        if request.status == RequestStatus.FINISHED_ABORTED and self.shared.pin_ttl_s > 0:
            self._pin(request, _block_table(block_ids), valid)
        return False, reply

    def _pin(self, request: Request, table: list[int], valid: int) -> None:
        tokens = request.all_token_ids
        # The last token's KV may still be in flight (computed by the step that samples the next one).
        n = min(valid, len(tokens) - 1)
        n -= n % self.block_size
        if n <= 0:
            return
        try:
            self.shared.pin(_caller_id(request.request_id), tokens[:n], table[: n // self.block_size])
        except Exception:  # never let a pin break vLLM's abort: the request just recomputes elsewhere
            logger.exception("pinning the KV of %s failed", request.request_id)

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            views, layout = cache_views(list(kv_caches.values()), self.block_size)
        except LayoutError as e:
            logger.warning("KV migration off: %s", e)
            return
        self.shared.register(views, layout)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, _Meta)
        for spec in meta.loads:
            if spec.load_async:
                self._async[spec.request_id] = self._pool.submit(self._load, spec)
            else:
                self._load(spec)

    def _load(self, spec: _LoadSpec) -> None:
        """Copy one request's KV into its blocks; a failure is logged and its blocks reported as load errors."""
        shared = self.shared
        try:
            if spec.pin is not None:
                ids = range(spec.first_block, spec.first_block + len(spec.dst_block_ids))
                _copy_blocks(spec.pin.layers, ids, shared.caches, spec.dst_block_ids)
            else:
                assert spec.offer is not None
                if spec.offer.transfer.num_ids != len(spec.dst_block_ids):
                    raise ValueError(f"{spec.offer.transfer.num_ids} blocks offered for {len(spec.dst_block_ids)}")
                _receive(spec.offer.transfer, shared.caches, spec.dst_block_ids, shared.mappings)
                c = shared.counters
                c.transfers_in += 1
                c.tokens_in += spec.offer.moved
                c.bytes_in += spec.offer.transfer.nbytes
                c.transfer_seconds_in += time.monotonic() - spec.started
            if shared.caches[0].is_cuda:  # the forward runs on vLLM's own stream: the blocks must be in first
                torch.cuda.current_stream(shared.caches[0].device).synchronize()
        except Exception as e:
            log_fallback(spec.params, e)
            shared.counters.fallbacks += 1
            spec.outcome.failed = True
            with self._errors_lock:
                self._load_errors.update(spec.dst_block_ids)
        finally:
            spec.outcome.done = True
            if spec.offer is not None:
                shared.loop.call_soon_threadsafe(shared.client.release, spec.params, spec.offer)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # sync loads complete in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # the source copies a pin out when its request ends (request_finished)

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = {rid for rid, future in self._async.items() if future.done()}
        for rid in done:
            del self._async[rid]
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        if self._role == KVConnectorRole.WORKER:
            self.shared.close()

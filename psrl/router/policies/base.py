"""The one interface every routing policy implements."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from psrl.router.registry import InstanceState

if TYPE_CHECKING:
    from psrl.router.config import CacheAwareConfig
    from psrl.router.policies.kv_index import KvEventIndex


class SelectionRequest(NamedTuple):
    """What a policy may look at: no HTTP objects, so policies are tested without a server. A named tuple: as
    immutable as a frozen dataclass, and a third of its cost to build (one per request)."""

    request_id: str
    model: str | None = None
    prompt_ids: Sequence[int] = ()
    text: str | None = None  # for workers reached over HTTP without token ids
    routing_key: str | None = None  # x-smg-routing-key

    def prefix_key(self) -> Sequence[int]:
        """What prefix-aware policies match on: token ids, else the UTF-8 bytes of the text."""
        if self.prompt_ids:
            return self.prompt_ids
        return self.text.encode("utf-8") if self.text else ()


class Policy(abc.ABC):
    """A routing policy: `select` picks an instance; the other members are optional capabilities whose
    defaults are those of a policy that keeps no state."""

    name: ClassVar[str]
    # Whether it matches on the prompt's text when the workers are reached over HTTP (no token ids).
    needs_text: ClassVar[bool] = False
    # The index of engine KV events it scores on; the router feeds it from each gRPC worker's subscription.
    kv_index: KvEventIndex | None = None

    @classmethod
    def from_settings(cls, cache_aware: CacheAwareConfig) -> Policy:
        """The policy as the router's settings make it (the cache-aware ones read their section)."""
        return cls()

    @abc.abstractmethod
    def select(self, candidates: Sequence[InstanceState], request: SelectionRequest) -> InstanceState:
        """Pick one of `candidates` (never empty); all are available."""

    def on_dispatched(self, instance: InstanceState, request: SelectionRequest) -> None:
        """The request was sent to `instance` (prefix policies record what it now caches)."""
        return None

    def on_worker_removed(self, worker_id: str) -> None:
        """Forget everything about a worker that left the registry."""
        return None

    def maybe_evict(self, now: float | None = None) -> bool:
        """Trim what the policy remembers, when it is due; the router calls it in the background. Returns
        whether it ran."""
        return False

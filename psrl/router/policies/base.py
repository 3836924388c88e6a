"""The one interface every routing policy implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from psrl.router.registry import InstanceState


@dataclass(frozen=True)
class SelectionRequest:
    """What a policy may look at: no HTTP objects, so policies are tested without a server."""

    request_id: str
    model: str | None = None
    prompt_ids: Sequence[int] = field(default=(), repr=False)
    text: str | None = field(default=None, repr=False)  # for workers reached over HTTP without token ids
    routing_key: str | None = None  # x-smg-routing-key

    def prefix_key(self) -> Sequence[int]:
        """What prefix-aware policies match on: token ids, else the UTF-8 bytes of the text."""
        if self.prompt_ids:
            return self.prompt_ids
        return self.text.encode("utf-8") if self.text else ()


class Policy(Protocol):
    name: str

    def select(self, candidates: Sequence[InstanceState], request: SelectionRequest) -> InstanceState:
        """Pick one of `candidates` (never empty); all are available."""
        ...

    def on_dispatched(self, instance: InstanceState, request: SelectionRequest) -> None:
        """The request was sent to `instance` (prefix policies record what it now caches)."""
        ...

    def on_worker_removed(self, worker_id: str) -> None:
        """Forget everything about a worker that left the registry."""
        ...


class StatelessPolicy:
    """Base for policies with nothing to record after a choice."""

    name = "stateless"

    def on_dispatched(self, instance: InstanceState, request: SelectionRequest) -> None:
        return None

    def on_worker_removed(self, worker_id: str) -> None:
        return None

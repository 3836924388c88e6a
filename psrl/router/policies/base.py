"""The one interface every routing policy implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from psrl.router.registry import Instance


@dataclass(frozen=True)
class SelectionRequest:
    """What a policy may look at: no HTTP objects, so policies are tested without a server."""

    request_id: str
    prompt_ids: Sequence[int] = field(default=(), repr=False)
    routing_key: str | None = None


class Policy(Protocol):
    name: str

    def select(self, candidates: Sequence[Instance], request: SelectionRequest) -> Instance:
        """Pick one of `candidates` (never empty)."""
        ...

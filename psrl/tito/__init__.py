"""TITO: token-in, token-out session records and the training arrays built from them.

The training API (build_training_arrays, the snapshot schema) needs numpy only. TitoStore, which templates and
tokenizes turns, is imported on first use, so that training code never loads the tokenizer's dependencies.
"""

from typing import TYPE_CHECKING

from psrl.tito.errors import (
    InvalidTurn,
    SessionNotFound,
    TemplateRenderError,
    TitoError,
    TooManyClientSessions,
    TooManySessions,
    TooManyTurns,
    TurnNotPrepared,
    TurnNotRecorded,
)
from psrl.tito.schema import Snapshot, SnapshotTrajectory, TurnRecord
from psrl.tito.training import (
    TrainingArrays,
    TrainingDataError,
    TrimTooLarge,
    build_all_training_arrays,
    build_training_arrays,
)
from psrl.tito.tree import PreparedTurn

if TYPE_CHECKING:
    from psrl.tito.store import TitoStore


def __getattr__(name: str) -> object:
    if name == "TitoStore":
        from psrl.tito.store import TitoStore

        return TitoStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "InvalidTurn",
    "PreparedTurn",
    "SessionNotFound",
    "Snapshot",
    "SnapshotTrajectory",
    "TemplateRenderError",
    "TitoError",
    "TitoStore",
    "TooManyClientSessions",
    "TooManySessions",
    "TooManyTurns",
    "TrainingArrays",
    "TrainingDataError",
    "TrimTooLarge",
    "TurnNotPrepared",
    "TurnNotRecorded",
    "TurnRecord",
    "build_all_training_arrays",
    "build_training_arrays",
]

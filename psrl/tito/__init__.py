"""TITO: token-in, token-out session records and the training arrays built from them."""

from psrl.tito.session import (
    InvalidTurn,
    PreparedTurn,
    SessionNotFound,
    TemplateRenderError,
    TitoError,
    TitoStore,
    TooManyClientSessions,
    TooManySessions,
    TooManyTurns,
    TurnNotPrepared,
    TurnNotRecorded,
)
from psrl.tito.training import (
    TrainingArrays,
    TrainingDataError,
    build_all_training_arrays,
    build_training_arrays,
)

__all__ = [
    "InvalidTurn",
    "PreparedTurn",
    "SessionNotFound",
    "TemplateRenderError",
    "TitoError",
    "TitoStore",
    "TooManyClientSessions",
    "TooManySessions",
    "TooManyTurns",
    "TrainingArrays",
    "TrainingDataError",
    "TurnNotPrepared",
    "TurnNotRecorded",
    "build_all_training_arrays",
    "build_training_arrays",
]

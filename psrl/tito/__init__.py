"""TITO: token-in, token-out session records and the training arrays built from them."""

from psrl.tito.training import (
    TrainingArrays,
    TrainingDataError,
    build_all_training_arrays,
    build_training_arrays,
)

__all__ = [
    "TrainingArrays",
    "TrainingDataError",
    "build_all_training_arrays",
    "build_training_arrays",
]

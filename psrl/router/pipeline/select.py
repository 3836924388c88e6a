"""Stage 3, select: resolve the model; the instance itself is chosen by psrl.router.selector.Selector."""

from __future__ import annotations

from psrl.router.errors import ModelNotFound, WorkerUnavailable
from psrl.router.registry import WorkerRegistry


def resolve_model(registry: WorkerRegistry, model: str | None) -> str:
    """The served model a request asks for; with no `model` field, the only (or first) one served."""
    served = registry.models()
    if not served:
        raise WorkerUnavailable("no workers are registered")
    if model is None:
        return served[0]
    if model not in served:
        raise ModelNotFound(f"The model `{model}` does not exist. Served: {', '.join(served)}", param="model")
    return model

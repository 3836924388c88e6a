"""Stage 3, select: resolve the model, gather healthy candidate instances, ask the policy."""

from __future__ import annotations

from psrl.router.errors import ModelNotFound, WorkerUnavailable
from psrl.router.policies import Policy, SelectionRequest
from psrl.router.registry import Instance, WorkerRegistry


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


def select_instance(registry: WorkerRegistry, policy: Policy, model: str, request: SelectionRequest) -> Instance:
    candidates = registry.candidates(model)
    if not candidates:
        raise WorkerUnavailable(f"no healthy instance serves model {model!r}")
    return policy.select(candidates, request)

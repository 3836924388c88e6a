"""The routing a tiny MoE model folder's reference forward pass takes: what replicas must report as routed experts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from psrl.engine import Qwen2Model
from psrl.worker.model_folder import load_model_folder


def reference_routing(moe_dir: Path, tokens: list[int]) -> np.ndarray:
    """[len(tokens), layers, top_k] expert ids of one unbatched forward over `tokens`."""
    folder = load_model_folder(moe_dir)
    model = Qwen2Model.from_safetensors(folder.model_config, moe_dir / "model.safetensors")
    routing: list[torch.Tensor] = []
    model.forward_full(tokens, routing=routing)
    return torch.stack(routing, dim=1).numpy().astype(np.uint8)

"""A tiny Qwen2-MoE model folder (`Qwen2MoeForCausalLM`): the tiny Qwen2 folder's tokenizer, a config.json with
Qwen2-MoE's keys, and optionally the reference engine's seeded float32 weights, which real vLLM loads too.

For routed experts (MoE routing replay) without downloading a model: the reference replica records the routing
of this model, and vLLM runs the same model with the same weights to the same tokens.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from psrl.worker.model_folder import WEIGHTS_FILE, build_tiny_model_folder, write_seeded_weights

TINY_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def build_tiny_moe_model_folder(folder: str | Path, *, seed: int | None = 0, moe: dict[str, Any] | None = None) -> Path:
    """Write the folder (once): tokenizer, Qwen2-MoE config.json (`moe` overrides TINY_MOE's keys) and, unless
    `seed` is None, seeded weights in model.safetensors."""
    path = Path(folder)
    config_file = path / "config.json"
    if not (config_file.is_file() and json.loads(config_file.read_text()).get("model_type") == "qwen2_moe"):
        build_tiny_model_folder(path)
        hf = json.loads(config_file.read_text())
        hf.update(TINY_MOE, **(moe or {}))
        hf.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", output_router_logits=False)
        fd, tmp = tempfile.mkstemp(prefix=".config-", dir=path)
        with os.fdopen(fd, "w") as f:
            json.dump(hf, f, indent=2)
        os.replace(tmp, config_file)
    if seed is not None and not (path / WEIGHTS_FILE).is_file():
        write_seeded_weights(path, seed)
    return path

"""Model configuration of the reference engine, under Hugging Face Qwen2 (and Qwen2-MoE) config names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from psrl.engine.errors import ConfigError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


# Hugging Face's Qwen2MoeConfig defaults, for a qwen2_moe config.json that leaves a key out (as vLLM reads it).
QWEN2_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": (),
}
MODEL_TYPES = ("qwen2", "qwen2_moe")


@dataclass(frozen=True)
class ModelConfig:
    """A small Qwen2-like decoder. Field names are HF's, so one config.json serves us and real vLLM.

    With `num_experts` > 0 it is a Qwen2-MoE (`Qwen2MoeForCausalLM`): the MLP of every `decoder_sparse_step`-th
    layer not in `mlp_only_layers` is a sparse MoE block (a softmax router picking `num_experts_per_tok` of
    `num_experts` experts of width `moe_intermediate_size`, renormalized if `norm_topk_prob`, plus a
    sigmoid-gated shared expert of width `shared_expert_intermediate_size` when that is > 0).
    """

    vocab_size: int = 512
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    num_experts: int = 0  # 0: a dense Qwen2
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.mlp_only_layers, tuple):  # config.json has a list
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        self.validate()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a MoE block (vLLM's and HF's Qwen2-MoE rule)."""
        return self.is_moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers with a MoE block, in order: the layer axis of routed experts."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_sparse_layer(i))

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.torch_dtype]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def validate(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim < 32 or self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim must be an even number >= 32, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        self._validate_moe()
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.torch_dtype not in TORCH_DTYPES:
            raise ConfigError(f"torch_dtype must be one of {sorted(TORCH_DTYPES)}, got {self.torch_dtype!r}")

    def _validate_moe(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.decoder_sparse_step, int) or self.decoder_sparse_step < 1:
            raise ConfigError(f"decoder_sparse_step must be a positive integer, got {self.decoder_sparse_step!r}")
        if not all(isinstance(i, int) and 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
            raise ConfigError(
                f"mlp_only_layers must name layers in [0, {self.num_hidden_layers}), got {self.mlp_only_layers}"
            )
        if not self.is_moe:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size < 1:
            raise ConfigError(f"moe_intermediate_size must be a positive integer, got {self.moe_intermediate_size}")
        if self.num_experts > 65536:
            raise ConfigError(f"at most 65536 experts (uint16 expert ids), got {self.num_experts}")

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a HF config.json dict; keys we do not model (bos/eos ids, sliding window, ...) are ignored."""
        model_type = hf.get("model_type")
        if model_type is not None and model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in names and v is not None}
        if model_type == "qwen2_moe":
            kwargs = {**QWEN2_MOE_DEFAULTS, **kwargs}
        else:  # a dense Qwen2 config may carry MoE-looking keys of no meaning to it
            for name in QWEN2_MOE_DEFAULTS:
                kwargs.pop(name, None)
        if "head_dim" not in kwargs and "hidden_size" in hf and "num_attention_heads" in hf:
            # HF Qwen2 configs usually omit head_dim: it is hidden_size / num_attention_heads.
            kwargs["head_dim"] = int(hf["hidden_size"]) // int(hf["num_attention_heads"])
        if "dtype" in hf and "torch_dtype" not in kwargs:  # newer transformers write "dtype"
            kwargs["torch_dtype"] = hf["dtype"]
        for name in ("rope_theta", "rms_norm_eps"):
            if name in kwargs:
                kwargs[name] = float(kwargs[name])
        return cls(**kwargs)

    def to_hf_config(
        self, *, bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None
    ) -> dict[str, Any]:
        moe = self.is_moe
        hf: dict[str, Any] = {
            "architectures": ["Qwen2MoeForCausalLM" if moe else "Qwen2ForCausalLM"],
            "model_type": "qwen2_moe" if moe else "qwen2",
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "initializer_range": 0.02,
            "use_cache": True,
        }
        hf.update(dataclasses.asdict(self))
        if moe:
            hf["mlp_only_layers"] = list(self.mlp_only_layers)
            hf["output_router_logits"] = False
        else:
            for name in QWEN2_MOE_DEFAULTS:
                del hf[name]
        hf["bos_token_id"] = bos_token_id
        hf["eos_token_id"] = eos_token_id
        return hf

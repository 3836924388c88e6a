"""Model configuration of the reference engine, under Hugging Face Qwen2 config names."""

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


@dataclass(frozen=True)
class ModelConfig:
    """A small Qwen2-like decoder. Field names are HF's, so one config.json serves us and real vLLM."""

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

    def __post_init__(self) -> None:
        self.validate()

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
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.torch_dtype not in TORCH_DTYPES:
            raise ConfigError(f"torch_dtype must be one of {sorted(TORCH_DTYPES)}, got {self.torch_dtype!r}")

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a HF config.json dict; keys we do not model (bos/eos ids, sliding window, ...) are ignored."""
        model_type = hf.get("model_type")
        if model_type is not None and model_type != "qwen2":
            raise ConfigError(f"model_type must be 'qwen2', got {model_type!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in names and v is not None}
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
        hf: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "initializer_range": 0.02,
            "use_cache": True,
        }
        hf.update(dataclasses.asdict(self))
        hf["bos_token_id"] = bos_token_id
        hf["eos_token_id"] = eos_token_id
        return hf

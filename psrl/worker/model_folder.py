"""A replica's model folder: config.json (Hugging Face Qwen2 names), tokenizer files, optional weights.

The embedded default is a tiny Qwen2-style folder built locally (tokenizer trained in milliseconds, seeded
random weights), the same shape a real vLLM replica can load with `load_format="dummy"`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from psrl.engine import ModelConfig
from psrl.tokenizer import Tokenizer, build_tiny_tokenizer, default_cache_dir

TINY_MODEL_NAME = "tiny-qwen2-v1"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class ModelFolder:
    path: Path
    model_config: ModelConfig
    tokenizer: Tokenizer
    bos_token_id: int | None = None  # config.json's, as vLLM reports it

    @property
    def weights_path(self) -> Path | None:
        path = self.path / WEIGHTS_FILE
        return path if path.is_file() else None


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def build_tiny_model_folder(folder: str | Path | None = None) -> Path:
    """Tokenizer + config.json for a small Qwen2-like model, written once (safe across processes)."""
    folder = Path(folder) if folder else default_cache_dir() / TINY_MODEL_NAME
    if (folder / "config.json").is_file():
        return folder
    build_tiny_tokenizer(folder)
    tok = Tokenizer.from_folder(folder)
    config = ModelConfig(vocab_size=_round_up(tok.vocab_size, 64))
    hf = config.to_hf_config(bos_token_id=tok.token_to_id("<|endoftext|>"), eos_token_id=list(tok.eos_token_ids))
    fd, tmp = tempfile.mkstemp(prefix=".config-", dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump(hf, f, indent=2)
    os.replace(tmp, folder / "config.json")
    return folder


def build_weighted_model_folder(folder: str | Path, seed: int = 0) -> Path:
    """The tiny model folder plus its seeded float32 `model.safetensors` (real weights for any engine, vLLM's too),
    each written once."""
    path = build_tiny_model_folder(folder)
    if not (path / WEIGHTS_FILE).is_file():
        write_seeded_weights(path, seed)
    return path


def write_seeded_weights(folder: str | Path, seed: int, path: str | Path | None = None) -> Path:
    """The folder's model with the reference engine's seeded random weights, saved as float32 safetensors
    (default: its `model.safetensors`, so any engine that reads the folder, vLLM too, loads real weights)."""
    from psrl.engine.model import Qwen2Model

    out = Path(path) if path is not None else Path(folder) / WEIGHTS_FILE
    Qwen2Model.random(load_model_folder(folder).model_config, seed).save_safetensors(out)
    return out


def load_model_folder(folder: str | Path) -> ModelFolder:
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json")
    hf_config = json.loads(config_file.read_text())
    model_config = ModelConfig.from_hf_config(hf_config)
    tokenizer = Tokenizer.from_folder(folder)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model_config.vocab_size}"
        )
    bos = hf_config.get("bos_token_id")
    return ModelFolder(folder, model_config, tokenizer, bos if isinstance(bos, int) else None)

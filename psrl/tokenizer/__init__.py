"""Tokenizers: load a model folder's tokenizer with its chat template, or build the tiny test one."""

from psrl.tokenizer.tiny import build_tiny_tokenizer, default_cache_dir
from psrl.tokenizer.tokenizer import (
    TEMPLATE_CALL_ARGS,
    ChatTemplateError,
    IncrementalDecoder,
    InvalidTextError,
    Tokenizer,
    TokenizerLoadError,
    lone_surrogate_at,
)

__all__ = [
    "TEMPLATE_CALL_ARGS",
    "ChatTemplateError",
    "IncrementalDecoder",
    "InvalidTextError",
    "Tokenizer",
    "TokenizerLoadError",
    "build_tiny_tokenizer",
    "default_cache_dir",
    "lone_surrogate_at",
]

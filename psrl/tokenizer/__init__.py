"""Tokenizers: load a model folder's tokenizer with its chat template, or build the tiny test one."""

from psrl.tokenizer.tiny import build_tiny_tokenizer, default_cache_dir
from psrl.tokenizer.tokenizer import ChatTemplateError, IncrementalDecoder, Tokenizer, TokenizerLoadError

__all__ = [
    "ChatTemplateError",
    "IncrementalDecoder",
    "Tokenizer",
    "TokenizerLoadError",
    "build_tiny_tokenizer",
    "default_cache_dir",
]

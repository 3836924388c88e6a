"""The tiny byte-level BPE tokenizer with a ChatML template, built locally for tests and the embedded default.

Nothing is downloaded: the BPE is trained in a few milliseconds on a fixed built-in corpus, so every machine
builds the same vocabulary. The folder is written once into a cache directory and reused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

TINY_TOKENIZER_NAME = "tiny-chatml-v1"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen-style tool-call markers: added (never split) but not special, so they survive decoding.
MARKER_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

_CORPUS = """
The quick brown fox jumps over the lazy dog. A rollout gateway routes requests to model replicas.
Reinforcement learning from feedback trains a policy on the tokens it sampled, so every token counts.
The trainer pushes new weights every few minutes; the replicas pause, load them, and resume.
Hello! How are you today? I am fine, thank you. What is the weather in Paris? It is sunny and warm.
Please call the tool to read the file, then summarize what it says in one short paragraph.
def add(a, b):
    return a + b

class Counter:
    def __init__(self):
        self.value = 0

    def step(self, n=1):
        self.value += n
        return self.value

for i in range(10):
    print(i, add(i, i))
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "read_file", "arguments": {"path": "/testbed/README.md"}}
{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {}}}
The answer is 42. One, two, three, four, five, six, seven, eight, nine, ten.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.718 -1 +1 = < > ( ) [ ] { } , ; : ! ?
You are a helpful assistant. The user asks a question and the assistant answers it step by step.
Water boils at one hundred degrees. The sun rises in the east and sets in the west.
"""

CHAT_TEMPLATE = (
    "{%- set default_system = 'You are a helpful assistant.' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] -}}"
    "{%- else -%}{{- default_system -}}{%- endif -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments'"
    " + ' within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>,'"
    " + ' \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages and messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if call.get('function') else call -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}"
    "{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def default_cache_dir() -> Path:
    """Where built artefacts (tokenizer, model folders) live: $PSRL_CACHE_DIR or ~/.cache/psrl."""
    return Path(os.environ.get("PSRL_CACHE_DIR") or Path.home() / ".cache" / "psrl")


def _train(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    tok.train_from_iterator(lines * 4, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    return tok


def build_tiny_tokenizer(folder: str | Path | None = None, *, vocab_size: int = 1024) -> Path:
    """Write tokenizer.json + tokenizer_config.json (ChatML template) into `folder`, once.

    Safe to call from several processes at once: the files are built in a temporary folder and moved in.
    """
    folder = Path(folder) if folder else default_cache_dir() / TINY_TOKENIZER_NAME
    if (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=folder))
    try:
        _train(vocab_size).save(str(tmp / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 4096,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_bos_token": False,
            "chat_template": CHAT_TEMPLATE,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            os.replace(tmp / name, folder / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder

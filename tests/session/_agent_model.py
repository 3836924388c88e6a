"""A scripted tiny model folder: a real Qwen2 checkpoint whose greedy reply to every prompt is one tool call.

The weights make the reference engine a bigram model. Every layer's o_proj and down_proj are zero, so the
residual stream at each position is just that token's embedding and the next-token logits depend on the last
token only. Seven "source" tokens get orthogonal one-hot embeddings, and lm_head maps each to its successor
with a large margin:

    "\\n" -> <tool_call> -> J1 -> a -> b -> J2 -> </tool_call> -> <|im_end|>

where J1 = `{"name": "lookup", "arguments": {"q": "` and J2 = `"}}` are added (non-special) tokens, and a, b
are single-character BPE tokens whose concatenation the tokenizer encodes as ONE other (merged) token. A chat
prompt always ends with the generation prompt `<|im_start|>assistant\\n`, so each assistant turn samples
exactly `chain` = [<tool_call>, J1, a, b, J2, </tool_call>, <|im_end|>], which decodes to
`<tool_call>{"name": "lookup", "arguments": {"q": "ab"}}</tool_call>` - and re-tokenizing that text gives the
merged token instead of a, b: the sampled ids cannot be recovered from the text.

All other tokens get random embeddings in the remaining dimensions (and lm_head random columns there), so
the model still says something arbitrary after any other token.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from psrl.engine import ModelConfig
from psrl.engine.model import expected_shapes
from psrl.tokenizer import Tokenizer, build_tiny_tokenizer
from psrl.worker.model_folder import WEIGHTS_FILE

TOOL_NAME = "lookup"
J1 = '{"name": "' + TOOL_NAME + '", "arguments": {"q": "'
J2 = '"}}'
MARGIN = 16.0  # logit of the scripted successor minus every other logit
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}


@dataclass(frozen=True)
class AgentModel:
    path: Path
    chain: list[int]  # the ids every assistant turn samples, <|im_end|> included
    chain_logprob: float  # the log-prob of each chain token (the same for all: one margin)
    a: str
    b: str
    merged_id: int  # the id the tokenizer gives the text a + b
    vocab_size: int  # the model's (padded) vocab

    @property
    def query(self) -> str:
        return self.a + self.b


def _merge_pair(tok: Tokenizer, merges: list) -> tuple[str, str, int]:
    """The first BPE merge of two single ASCII letters whose concatenation encodes as one token."""
    for merge in merges:
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        if not (len(a) == len(b) == 1 and a.isascii() and b.isascii() and a.isalpha() and b.isalpha()):
            continue
        ia, ib, iab = tok.token_to_id(a), tok.token_to_id(b), tok.token_to_id(a + b)
        if None in (ia, ib, iab):
            continue
        if tok.encode(a) == [ia] and tok.encode(b) == [ib] and tok.encode(a + b) == [iab]:
            return a, b, iab
    raise RuntimeError("the tiny tokenizer has no merge of two single letters")


def build_agent_model_folder(folder: str | Path) -> AgentModel:
    """Write tokenizer.json (+ J1, J2), tokenizer_config.json, config.json and model.safetensors into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = build_tiny_tokenizer(folder / ".base-tokenizer")
    shutil.copy(base / "tokenizer_config.json", folder / "tokenizer_config.json")
    hf = HFTokenizer.from_file(str(base / "tokenizer.json"))
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in (J1, J2)])
    hf.save(str(folder / "tokenizer.json"))
    shutil.rmtree(folder / ".base-tokenizer")

    tok = Tokenizer.from_folder(folder)
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    a, b, merged_id = _merge_pair(tok, merges)

    def tid(text: str) -> int:
        i = tok.token_to_id(text)
        assert i is not None, text
        return i

    newline = tok.encode("<|im_start|>assistant\n")[-1]
    assert tok.decode([newline]) == "\n"
    chain = [tid("<tool_call>"), tid(J1), tid(a), tid(b), tid(J2), tid("</tool_call>"), tid("<|im_end|>")]
    sources = [newline, *chain[:-1]]
    assert len(set(sources + chain)) == len(chain) + 1, "every chain token must be unique"

    config = ModelConfig(vocab_size=-(-tok.vocab_size // 64) * 64, tie_word_embeddings=False)
    # An untied head: lm_head is its own tensor (a tied one would be the embedding matrix, which cannot be both
    # one-hot rows for the sources and the successor map).
    assert not config.tie_word_embeddings
    h, v = config.hidden_size, config.vocab_size
    n_src = len(sources)
    assert n_src < h

    sd = {name: torch.zeros(shape) for name, shape in expected_shapes(config).items()}
    for name in sd:
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            sd[name].fill_(1.0)
    gen = torch.Generator().manual_seed(1234)
    embed = torch.zeros(v, h)
    embed[:, n_src:] = torch.randn(v, h - n_src, generator=gen)
    lm_head = torch.zeros(v, h)
    lm_head[:, n_src:] = torch.randn(v, h - n_src, generator=gen) * (3.0 / math.sqrt(h))
    lm_head[tok.vocab_size :] = 0.0  # padding rows: never preferred after a scripted token either
    # With a one-hot embedding e_k the final RMSNorm output is sqrt(h / (1 + h * eps)) * e_k.
    scale = math.sqrt(h / (1.0 + h * config.rms_norm_eps))
    for k, (src, nxt) in enumerate(zip(sources, chain)):
        embed[src] = 0.0
        embed[src, k] = 1.0
        lm_head[nxt, k] = MARGIN / scale
    sd["model.embed_tokens.weight"] = embed
    sd["lm_head.weight"] = lm_head
    save_file({k: t.contiguous() for k, t in sd.items()}, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})

    hf_config = config.to_hf_config(bos_token_id=tid("<|endoftext|>"), eos_token_id=list(tok.eos_token_ids))
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    chain_logprob = -math.log1p((v - 1) * math.exp(-MARGIN))
    return AgentModel(folder, chain, chain_logprob, a, b, merged_id, v)

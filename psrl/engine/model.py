"""Qwen2-style decoder-only transformer: a plain causal reference path and the paged-KV path the engine runs.

Weights are held under Hugging Face Qwen2 names (so a safetensors file is interchangeable with real
checkpoints); q/k/v and gate/up are fused once at load time for the hot path. A config with experts makes it a
Qwen2-MoE (HF's and vLLM's `Qwen2MoeForCausalLM`, same tensor names): both forward paths can then report each
token's top-k expert ids per MoE layer (`routing`), what vLLM returns as routed experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from psrl.engine.config import ModelConfig
from psrl.engine.errors import WeightLoadError

# Buffers some HF checkpoints carry that are derived, not learned; accepted and ignored on load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_MIN_ROWS = 16
_ROW_MULTIPLE = 8


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen2ForCausalLM checkpoint for `config`, by HF name."""
    h, hd = config.hidden_size, config.head_dim
    q_out = config.num_attention_heads * hd
    kv_out = config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q_out, h),
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.weight": (kv_out, h),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.weight": (kv_out, h),
                p + "self_attn.v_proj.bias": (kv_out,),
                p + "self_attn.o_proj.weight": (h, q_out),
            }
        )
        # In this order (the MLP before the norms): seeded weights are drawn tensor by tensor in it.
        if config.is_sparse_layer(i):
            shapes.update(_moe_shapes(config, p + "mlp."))
        else:
            shapes.update(_mlp_shapes(p + "mlp.", h, config.intermediate_size))
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (width, hidden),
        prefix + "up_proj.weight": (width, hidden),
        prefix + "down_proj.weight": (hidden, width),
    }


def _moe_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """A Qwen2-MoE sparse block. The shared expert's gate is there even without a shared expert: vLLM's
    Qwen2MoeSparseMoeBlock always has that weight, so its loader wants it in the checkpoint."""
    h = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        prefix + "gate.weight": (config.num_experts, h),
        prefix + "shared_expert_gate.weight": (1, h),
    }
    for j in range(config.num_experts):
        shapes.update(_mlp_shapes(f"{prefix}experts.{j}.", h, config.moe_intermediate_size))
    if config.shared_expert_intermediate_size > 0:
        shapes.update(_mlp_shapes(prefix + "shared_expert.", h, config.shared_expert_intermediate_size))
    return shapes


def random_state_dict(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights, scaled so that a random model has lively logits and a greedy run does not collapse.

    Plain std=0.02 init gives logits with a spread of ~0.2 and a model that repeats one token; here
    projections use std 1/sqrt(fan_in) (unit-variance activations) and the embeddings/lm_head are
    scaled so that logits have a standard deviation of a few units and attention actually mixes context.
    """
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=gen)
        elif name == "lm_head.weight":
            t = torch.randn(shape, generator=gen) * (3.0 / math.sqrt(shape[1]))
        elif name.endswith(".bias"):
            t = torch.randn(shape, generator=gen) * 0.5
        else:
            fan_in = shape[1]
            t = torch.randn(shape, generator=gen) * (1.0 / math.sqrt(fan_in))
        out[name] = t.to(config.dtype)
    return out


def load_safetensors_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise WeightLoadError(f"weights file {path} does not exist")
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = f.get_tensor(name)
    except WeightLoadError:
        raise
    except Exception as exc:  # a corrupt or foreign file: say which
        raise WeightLoadError(f"cannot read safetensors file {path}: {exc}") from exc
    return tensors


def check_state_dict(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> None:
    """Raise WeightLoadError naming every missing, unexpected and mis-shaped tensor."""
    shapes = expected_shapes(config)
    present = {k for k in state_dict if not k.endswith(_IGNORED_SUFFIXES)}
    missing = sorted(set(shapes) - present)
    unexpected = sorted(present - set(shapes))
    if config.tie_word_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")  # some exporters write the tied head anyway
    bad_shape = [
        f"{k}: expected {shapes[k]}, got {tuple(state_dict[k].shape)}"
        for k in sorted(present & set(shapes))
        if tuple(state_dict[k].shape) != shapes[k]
    ]
    bad_dtype = [
        f"{k}: {state_dict[k].dtype}" for k in sorted(present & set(shapes)) if not state_dict[k].is_floating_point()
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {missing}")
    if unexpected:
        problems.append(f"unexpected tensors: {unexpected}")
    if bad_shape:
        problems.append(f"mis-shaped tensors: {bad_shape}")
    if bad_dtype:
        problems.append(f"non-floating tensors: {bad_dtype}")
    if problems:
        raise WeightLoadError("weights do not match the model config; " + "; ".join(problems))


def padded_rows(n: int) -> int:
    """Row count the paged path runs its matmuls with, for `n` real rows.

    CPU GEMM kernels pick different code paths (and summation orders) for very small or odd row counts,
    so a token's logits would differ in the last bits between running alone and running batched. Padding
    to a multiple of 8 and at least 16 rows keeps each row's result independent of the batch (checked
    for the oneDNN/MKL CPU kernels; attention is per sequence anyway), so greedy decoding does not depend
    on what else is batched, which is what KV migration must prove.
    """
    return max(_MIN_ROWS, -(-n // _ROW_MULTIPLE) * _ROW_MULTIPLE)


@dataclass
class DecodeGroup:
    """Single-token queries whose sequences span the same number of blocks, attended in one batched call."""

    token_index: torch.Tensor  # [B] rows of the flattened batch
    block_table: torch.Tensor  # [B, num_blocks_in_group]
    kv_mask: torch.Tensor  # [B, 1, 1, num_blocks_in_group * block_size], True = attend


@dataclass
class PrefillSeq:
    """A chunk of one sequence's tokens (prompt or recompute), attended on its own with a causal mask."""

    start: int  # first row in the flattened batch
    num_tokens: int
    context_len: int  # tokens in the KV cache after this step, this chunk included
    block_ids: torch.Tensor  # [blocks covering context_len]
    mask: torch.Tensor  # [1, num_queries_per_kv * num_tokens, context_len]


@dataclass
class PagedBatch:
    """Everything one paged forward needs, built once per step and shared by all layers."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat slot (block_id * block_size + offset) to write each token's K/V
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSeq]
    logits_index: torch.Tensor  # [S] rows whose next-token logits are needed


def _gate_up(sd: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    return torch.cat([sd[prefix + "gate_proj.weight"], sd[prefix + "up_proj.weight"]])


class _Moe:
    """One layer's sparse MoE block, experts' gate/up fused like the dense MLP's."""

    __slots__ = ("downs", "gate_ups", "norm_topk", "router", "shared_down", "shared_gate", "shared_gate_up", "top_k")

    def __init__(self, sd: dict[str, torch.Tensor], prefix: str, config: ModelConfig) -> None:
        self.router = sd[prefix + "gate.weight"]
        self.top_k = config.num_experts_per_tok
        self.norm_topk = config.norm_topk_prob
        self.gate_ups = [_gate_up(sd, f"{prefix}experts.{j}.") for j in range(config.num_experts)]
        self.downs = [sd[f"{prefix}experts.{j}.down_proj.weight"] for j in range(config.num_experts)]
        self.shared_gate = sd[prefix + "shared_expert_gate.weight"]
        self.shared_gate_up: torch.Tensor | None = None
        self.shared_down: torch.Tensor | None = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_gate_up = _gate_up(sd, prefix + "shared_expert.")
            self.shared_down = sd[prefix + "shared_expert.down_proj.weight"]


class _Layer:
    __slots__ = ("down", "gate_up", "in_norm", "moe", "o_proj", "post_norm", "qkv_b", "qkv_w")

    def __init__(self, sd: dict[str, torch.Tensor], i: int, config: ModelConfig) -> None:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        self.qkv_w = torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]])
        self.qkv_b = torch.cat([sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"]])
        self.o_proj = sd[a + "o_proj.weight"]
        self.moe = _Moe(sd, p + "mlp.", config) if config.is_sparse_layer(i) else None
        self.gate_up = None if self.moe is not None else _gate_up(sd, p + "mlp.")
        self.down = None if self.moe is not None else sd[p + "mlp.down_proj.weight"]
        self.in_norm = sd[p + "input_layernorm.weight"]
        self.post_norm = sd[p + "post_attention_layernorm.weight"]


class Qwen2Model:
    """Inference-only Qwen2 decoder. Immutable once built: a weight swap builds a new instance."""

    def __init__(
        self, config: ModelConfig, state_dict: dict[str, torch.Tensor], *, device: str | torch.device = "cpu"
    ) -> None:
        check_state_dict(config, state_dict)
        self.config = config
        self.device = torch.device(device)
        self.dtype = config.dtype
        sd = {
            k: v.detach().to(device=self.device, dtype=self.dtype).contiguous()
            for k, v in state_dict.items()
            if k in expected_shapes(config)
        }
        if config.tie_word_embeddings:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        self._sd = sd
        self.embed = sd["model.embed_tokens.weight"]
        self.lm_head = sd["lm_head.weight"]
        self.final_norm = sd["model.norm.weight"]
        self.layers = [_Layer(sd, i, config) for i in range(config.num_hidden_layers)]
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self._cos, self._sin = self._rope_tables()

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def random(cls, config: ModelConfig, seed: int, *, device: str | torch.device = "cpu") -> Qwen2Model:
        return cls(config, random_state_dict(config, seed), device=device)

    @classmethod
    def from_safetensors(
        cls, config: ModelConfig, path: str | Path, *, device: str | torch.device = "cpu"
    ) -> Qwen2Model:
        return cls(config, load_safetensors_state_dict(path), device=device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named tensors (lm_head omitted when tied, as HF saves it)."""
        names = expected_shapes(self.config)
        return {k: v for k, v in self._sd.items() if k in names}

    def save_safetensors(self, path: str | Path) -> None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(path), metadata={"format": "pt"})

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Computed in float64 then rounded once, so both forward paths read identical tables.
        hd = self.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        t = torch.arange(self.config.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        return (
            freqs.cos().to(device=self.device, dtype=torch.float32),
            freqs.sin().to(device=self.device, dtype=torch.float32),
        )

    # ---- shared pieces --------------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Neox-style rotary embedding; x is [T, heads, head_dim], cos/sin are [T, 1, head_dim/2]."""
        half = self.head_dim // 2
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def _qkv(
        self, layer: _Layer, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = h.shape[0]
        qkv = F.linear(self._rms_norm(h, layer.in_norm), layer.qkv_w, layer.qkv_b)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        cos = self._cos[positions].unsqueeze(1)
        sin = self._sin[positions].unsqueeze(1)
        q = self._rope(q.reshape(t, self.num_heads, self.head_dim), cos, sin)
        k = self._rope(k.reshape(t, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, v.reshape(t, self.num_kv_heads, self.head_dim)

    def _mlp_block(
        self, layer: _Layer, h: torch.Tensor, n: int | None = None, routing: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The MLP half of a layer. `n`: how many leading rows are real (the rest is padding, see padded_rows);
        `routing`: where a MoE layer appends its rows' top-k expert ids [n, top_k]."""
        x = self._rms_norm(h, layer.post_norm)
        if layer.moe is not None:
            return h + self._moe(layer.moe, x, h.shape[0] if n is None else n, routing)
        assert layer.gate_up is not None and layer.down is not None
        return h + _swiglu(x, layer.gate_up, layer.down)

    def _moe(self, moe: _Moe, x: torch.Tensor, n: int, routing: list[torch.Tensor] | None) -> torch.Tensor:
        """HF's Qwen2MoeSparseMoeBlock: softmax over the router's logits, the top-k experts (renormalized with
        norm_topk_prob), each expert run once over the rows routed to it, plus the gated shared expert.

        Only the `n` real rows are routed. Each expert's rows are padded like the batch (padded_rows), so a
        token's output does not depend on which other tokens share its experts in this step."""
        probs = torch.softmax(F.linear(x, moe.router)[:n], dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, moe.top_k, dim=-1)
        if moe.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        if routing is not None:
            routing.append(experts)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            rows, slots = torch.nonzero(experts == e, as_tuple=True)
            m = rows.shape[0]
            xe = F.pad(x[rows], (0, 0, 0, padded_rows(m) - m))
            ye = _swiglu(xe, moe.gate_ups[e], moe.downs[e])[:m]
            out.index_add_(0, rows, ye * weights[rows, slots].unsqueeze(-1))
        if moe.shared_gate_up is not None and moe.shared_down is not None:
            out = out + torch.sigmoid(F.linear(x, moe.shared_gate)) * _swiglu(x, moe.shared_gate_up, moe.shared_down)
        return out

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms_norm(h, self.final_norm), self.lm_head).float()

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")

    # ---- reference path -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_full(
        self, token_ids: list[int] | torch.Tensor, *, routing: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Logits [T, vocab] (float32) of one sequence with plain causal attention and no cache. `routing`:
        each MoE layer appends its top-k expert ids [T, top_k] (in layer order)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)
        self._check_ids(ids)
        t = ids.shape[0]
        if t > self.config.max_position_embeddings:
            raise ValueError(f"{t} tokens exceed max_position_embeddings={self.config.max_position_embeddings}")
        positions = torch.arange(t, device=self.device)
        causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
        g = self.num_heads // self.num_kv_heads
        scale = 1.0 / math.sqrt(self.head_dim)
        h = self.embed[ids]
        for layer in self.layers:
            q, k, v = self._qkv(layer, h, positions)
            # [heads, T, hd]; kv head j serves query heads j*g .. j*g+g-1 (HF repeat_kv).
            q = q.transpose(0, 1).float()
            k = k.repeat_interleave(g, dim=1).transpose(0, 1).float()
            v = v.repeat_interleave(g, dim=1).transpose(0, 1).float()
            scores = (q @ k.transpose(1, 2)) * scale
            scores = scores.masked_fill(~causal, float("-inf"))
            attn = torch.softmax(scores, dim=-1) @ v  # [heads, T, hd]
            attn = attn.transpose(0, 1).reshape(t, self.q_size).to(self.dtype)
            h = h + F.linear(attn, layer.o_proj)
            h = self._mlp_block(layer, h, routing=routing)
        return self._logits(h)

    # ---- paged path -----------------------------------------------------------------------------

    def forward_paged(
        self, batch: PagedBatch, kv_layers: list[torch.Tensor], *, routing: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """One forward over a flattened batch of tokens from many sequences.

        Writes each token's K/V into `kv_layers` at `slot_mapping`, attends every query over its own
        sequence's blocks, and returns float32 logits for the rows in `logits_index` only. `routing`: each MoE
        layer appends the top-k expert ids [T, top_k] of the batch's rows (in layer order).
        """
        n = batch.input_ids.shape[0]
        t = padded_rows(n)  # rows past n are padding, see padded_rows
        h = self.embed[F.pad(batch.input_ids, (0, t - n))]
        positions = F.pad(batch.positions, (0, t - n))
        g = self.num_heads // self.num_kv_heads
        for layer, cache in zip(self.layers, kv_layers):
            q, k, v = self._qkv(layer, h, positions)
            flat = cache.view(2, -1, self.num_kv_heads, self.head_dim)
            flat[0].index_copy_(0, batch.slot_mapping, k[:n])
            flat[1].index_copy_(0, batch.slot_mapping, v[:n])
            out = torch.zeros(t, self.q_size, dtype=h.dtype, device=h.device)
            for group in batch.decode_groups:
                out.index_copy_(0, group.token_index, self._decode_attention(q, cache, group, g))
            for seq in batch.prefills:
                out[seq.start : seq.start + seq.num_tokens] = self._prefill_attention(q, cache, seq, g)
            h = h + F.linear(out, layer.o_proj)
            h = self._mlp_block(layer, h, n, routing)
        s = batch.logits_index.shape[0]
        return self._logits(F.pad(h[batch.logits_index], (0, 0, 0, padded_rows(s) - s)))[:s]

    def _decode_attention(self, q: torch.Tensor, cache: torch.Tensor, group: DecodeGroup, g: int) -> torch.Tensor:
        b, nb = group.block_table.shape
        # The g query heads sharing a kv head stand in the "query length" slot: no K/V repeat needed.
        qg = q[group.token_index].view(b, self.num_kv_heads, g, self.head_dim)
        kv = cache[:, group.block_table].view(2, b, nb * cache.shape[2], self.num_kv_heads, self.head_dim)
        k = kv[0].transpose(1, 2)
        v = kv[1].transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.kv_mask)
        return o.reshape(b, self.q_size)

    def _prefill_attention(self, q: torch.Tensor, cache: torch.Tensor, seq: PrefillSeq, g: int) -> torch.Tensor:
        n, ctx = seq.num_tokens, seq.context_len
        qs = q[seq.start : seq.start + n].view(n, self.num_kv_heads, g, self.head_dim)
        qs = qs.permute(1, 2, 0, 3).reshape(self.num_kv_heads, g * n, self.head_dim)
        kv = cache[:, seq.block_ids].view(2, -1, self.num_kv_heads, self.head_dim)[:, :ctx]
        k = kv[0].transpose(0, 1)
        v = kv[1].transpose(0, 1)
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=seq.mask)  # [kvh, g*n, hd]
        return o.view(self.num_kv_heads, g, n, self.head_dim).permute(2, 0, 1, 3).reshape(n, self.q_size)


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)

"""Llama-family decoder (Llama, Mistral, Qwen2; SmolLM3 and Granite in their own modules) over a paged KV cache.

Numerics follow transformers' implementation (float32 RMSNorm, float32 rotary tables cast to the
activation dtype) so greedy tokens match it. Q/K/V and gate/up are merged into one matmul each.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend, AttentionMetadata
from pagedserve.worker.ops import apply_rotary, rms_norm_native  # noqa: F401 (apply_rotary: re-exported)
from pagedserve.worker.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    even_shard,
    head_shards,
    load_model_weights,
)
from pagedserve.worker.process_group import tp_group
from pagedserve.worker.platform import current_platform


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_native(x, self.weight, self.eps)


class LlamaAttention(nn.Module):
    """This rank's query heads and the KV heads they use: QKV column-parallel, O row-parallel."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        tp = tp_group()
        q_shard, kv_shard = head_shards(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, tp)
        self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = q_shard.size // cfg.head_dim, kv_shard.size // cfg.head_dim
        self.split = (q_shard.size, kv_shard.size, kv_shard.size)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_shard, kv_shard, kv_shard], bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size)
        self.backend = backend
        self.ops = current_platform().ops
        self.scale = self.head_dim ** -0.5
        self.use_rope = True  # False: a NoPE layer (SmolLM3's), its queries and keys take no rotary

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim], k and v [tokens, kv heads, head_dim]: this rank's heads, one matmul."""
        num_tokens = hidden.shape[0]
        q, k, v = self.ops.linear(hidden, self.qkv_proj).split(self.split, dim=-1)
        return (q.view(num_tokens, self.num_heads, self.head_dim), k.view(num_tokens, self.num_kv_heads, self.head_dim),
                v.view(num_tokens, self.num_kv_heads, self.head_dim))

    def forward(self, hidden, rope, kv_cache, meta: AttentionMetadata):
        num_tokens, ops = hidden.shape[0], self.ops
        q, k, v = self.project(hidden)
        if self.use_rope:
            q, k = ops.rotary(q, k, rope)
        attn = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return ops.linear(attn.reshape(num_tokens, -1), self.o_proj)


class LlamaMLP(nn.Module):
    """SiLU-gated MLP: gate/up column-parallel (one matmul), down row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, reduce: bool = True) -> None:
        super().__init__()
        shard = even_shard(intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [shard, shard])
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce=reduce)
        self.ops = current_platform().ops

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        return ops.linear(ops.silu_and_mul(ops.linear(hidden, self.gate_up_proj)), self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden, rope, kv_cache, meta: AttentionMetadata):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_fused(self, out, residual, rope, kv_cache, meta: AttentionMetadata, ops):
        """The same layer with each residual add fused into the norm after it (ops.rms_norm):
        takes the previous layer's MLP output and the running residual (None at the first layer,
        where `out` is the embedding), returns this layer's MLP output and the residual, which
        it updates in place."""
        if residual is None:
            residual, normed = out, ops.rms_norm(out, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            normed = ops.rms_norm(out, self.input_layernorm.weight, self.input_layernorm.eps, residual)
        out = self.self_attn(normed, rope, kv_cache, meta)
        normed = ops.rms_norm(out, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps, residual)
        return self.mlp(normed), residual


# HF projection name -> (our merged module, part): q/k/v and gate/up each run as one matmul.
MERGED_PROJECTIONS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaForCausalLM(nn.Module):
    """Also the skeleton of the MoE models: they override make_attention / make_mlp / map_name."""

    # whether forward reads the step's layout on the host beyond what the attention backends read (the
    # metadata's prefill list): such a model's mixed steps cannot be captured in a graph (graph_runner.py)
    reads_layout_on_host = False

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = current_platform().ops
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.make_attention(i, backend), self.make_mlp(i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.init_rope(max_positions)
        self.requires_grad_(False)
        self._fused_norms: bool | None = None

    def make_attention(self, layer_index: int, backend: AttentionBackend) -> nn.Module:
        return LlamaAttention(self.cfg, backend)

    def make_mlp(self, layer_index: int) -> nn.Module:
        return LlamaMLP(self.cfg.hidden_size, self.cfg.intermediate_size)

    def init_rope(self, max_positions: int) -> None:
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(self.cfg))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.ops.rope(self.cos_table, self.sin_table, positions, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds: the step's embeddings given (a LLaVA's image rows among them), else input_ids'."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rope(positions, hidden.dtype)
        if self.fused_norms:
            out, residual, ops = hidden, None, self.ops
            for i, layer in enumerate(self.layers):
                out, residual = layer.forward_fused(out, residual, rope, kv_caches[i], meta, ops)
            return ops.rms_norm(out, self.norm.weight, self.norm.eps, residual)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, rope, kv_caches[i], meta)
        return self.norm(hidden)

    @property
    def fused_norms(self) -> bool:
        """Whether the ops bundle fuses each norm with the residual add before it, and every norm
        and layer is the plain kind it can fuse."""
        if self._fused_norms is None:
            norms = [self.norm] + [n for layer in self.layers for n in (layer.input_layernorm,
                                                                       layer.post_attention_layernorm)]
            self._fused_norms = (self.ops.fused_residual_norm and all(type(n) is RMSNorm for n in norms)
                                 and all(type(layer) is DecoderLayer for layer in self.layers))
        return self._fused_norms

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.logits(hidden, self.embed_tokens if self.lm_head is None else self.lm_head)

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        """Take HF-named checkpoint tensors (weights.LazyWeight); each rank reads its shard only."""
        load_model_weights(self, weights, self.map_name)

    def map_name(self, name: str) -> tuple[str, object] | None:
        """HF name -> (parameter name, part), or None for a tensor this model does not use."""
        if "rotary_emb" in name:
            return None
        if name.startswith("lm_head."):
            return None if self.lm_head is None else (name, 0)
        if not name.startswith("model."):
            return None
        name = name[len("model."):]
        for proj, (merged, part) in MERGED_PROJECTIONS.items():
            if f".self_attn.{proj}." in name or f".mlp.{proj}." in name:
                head, _, tail = name.partition(f".{proj}.")
                return f"{head}.{merged}.{tail}", part
        return name, 0

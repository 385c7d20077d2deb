"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Numerics follow transformers' implementation (float32 RMSNorm, float32 rotary tables cast to the
activation dtype) so greedy tokens match it. Q/K/V and gate/up are merged into one matmul each.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model_config import ModelConfig
from services.worker.attention import AttentionBackend, AttentionMetadata


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
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


SMALL_M = 8  # up to this many rows the CPU kernel's streaming matmul beats MKL (2-3x at 1-8 rows)


def use_small_m(x: torch.Tensor, cpu_ops) -> bool:
    return cpu_ops is not None and x.shape[0] <= SMALL_M and x.dtype == torch.float32 and x.shape[1] % 8 == 0


def linear(x: torch.Tensor, layer: nn.Linear, cpu_ops) -> torch.Tensor:
    if use_small_m(x, cpu_ops):
        out = cpu_ops.small_m_linear(x.contiguous(), layer.weight)
        return out if layer.bias is None else out + layer.bias
    return layer(x)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, cpu_ops=None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.backend = backend
        self.cpu_ops = cpu_ops  # fused rotary and silu*mul from kernels/cpu, when compiled
        self.scale = self.head_dim ** -0.5

    def forward(self, hidden, rope, k_cache, v_cache, meta: AttentionMetadata):
        num_tokens = hidden.shape[0]
        residual = hidden
        hidden = self.input_layernorm(hidden)
        ops = self.cpu_ops
        q, k, v = linear(hidden, self.qkv_proj, ops).split(self.split, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if ops is not None:
            ops.rotary_inplace(q, k, *rope)
        else:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        attn = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        hidden = residual + linear(attn.reshape(num_tokens, -1), self.o_proj, ops)
        residual = hidden
        gate_up = linear(self.post_attention_layernorm(hidden), self.gate_up_proj, ops)
        if ops is not None:
            return residual + linear(ops.silu_and_mul(gate_up), self.down_proj, ops)
        gate, up = gate_up.chunk(2, dim=-1)
        return residual + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int, cpu_ops=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, cpu_ops) for _ in range(cfg.num_hidden_layers))
        self.cpu_ops = cpu_ops
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.cpu_ops is not None:
            rope = (self.cos_table, self.sin_table, positions)
        else:
            rope = (self.cos_table[positions].to(hidden.dtype).unsqueeze(1),
                    self.sin_table[positions].to(hidden.dtype).unsqueeze(1))
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, rope, kv_caches[i, 0], kv_caches[i, 1], meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if use_small_m(hidden, self.cpu_ops):
            return self.cpu_ops.small_m_linear(hidden.contiguous(), weight)
        if hidden.device.type == "cpu":
            # [vocab, hidden] @ [hidden, rows]: MKL streams the big weight once; F.linear's layout
            # ran 1.5-2x slower for decode batches on a 49k vocabulary.
            return torch.mm(weight, hidden.t()).t().float().contiguous()
        return F.linear(hidden, weight).float()


    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        """Take HF-named tensors; every parameter must be filled exactly once."""
        params = dict(self.named_parameters())
        pending = set(params)
        cfg = self.cfg
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        shard_offsets = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv),
                         "v_proj": ("qkv_proj", q + kv, kv),
                         "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
                         "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size)}
        filled: dict[str, int] = {}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            target, rows = self._map_name(name, shard_offsets)
            if target is None:
                continue
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint")
            param = params[target]
            dest = param.data if rows is None else param.data.narrow(0, rows[0], rows[1])
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + (dest.shape[0] if rows else param.shape[0])
            if filled[target] >= param.shape[0]:
                pending.discard(target)
        if pending:
            raise ValueError(f"the checkpoint lacks {len(pending)} weights, e.g. {sorted(pending)[:3]}")

    def _map_name(self, name: str, shard_offsets):
        if name.startswith("lm_head."):
            return (None, None) if self.lm_head is None else (name, None)
        if not name.startswith("model."):
            return None, None
        name = name[len("model."):]
        for proj, (merged, start, size) in shard_offsets.items():
            if f".{proj}." in name:
                head, _, tail = name.partition(f".{proj}.")
                layer = head.replace(".self_attn", "").replace(".mlp", "")
                return f"{layer}.{merged}.{tail}", (start, size)
        return name.replace(".self_attn.", ".").replace(".mlp.", "."), None

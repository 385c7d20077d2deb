"""OLMo 2 (AllenAI's Olmo2ForCausalLM): the Llama layers with two differences, as transformers' own:

- the norms come after the sublayers: h + post_attention_layernorm(attn(h)), then
  h + post_feedforward_layernorm(mlp(h)); there is no norm before them;
- the queries and keys are RMS-normed over the whole projection (all heads at once, one weight of
  heads x head_dim) before the rotary embedding.

Under tensor parallelism a rank holds some of the heads: its q/k norms hold their slice of the
weight and sum the squares across ranks (one all_reduce of one float per token each), so every
rank divides by the whole projection's root mean square. KV heads replicated across ranks (fewer
than ranks) are refused: their squares would be counted more than once.
Norms multiply by the weight in float32 before the cast, as transformers' Olmo2RMSNorm does.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend, AttentionMetadata
from pagedserve.worker.models.llama import LlamaAttention, LlamaForCausalLM
from pagedserve.worker.parallel import Shard, copy_checked, head_shards, mark_loader, new_param
from pagedserve.worker.process_group import all_reduce, tp_group


class Olmo2RMSNorm(nn.Module):
    """RMSNorm whose weight multiplies in float32 (transformers' Olmo2RMSNorm). shard: the rows of
    a projection this rank holds, of `full_size` in all (the mean square is summed across ranks)."""

    def __init__(self, size: int, eps: float, shard: Shard | None = None, full_size: int | None = None) -> None:
        super().__init__()
        self.shard, self.full_size, self.eps = shard, full_size or size, eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        if shard is not None:
            self.weight = new_param(shard.size)
            mark_loader(self.weight, self._load, 1)

    def _load(self, param: nn.Parameter, loaded, part: int) -> None:
        copy_checked(param.data, loaded.narrow(0, self.shard.start, self.shard.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        if self.shard is None:
            variance = out.pow(2).mean(-1, keepdim=True)
        else:
            variance = all_reduce(out.pow(2).sum(-1, keepdim=True)) / self.full_size
        out = out * torch.rsqrt(variance + self.eps)
        return (self.weight.float() * out).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(cfg, backend)
        tp = tp_group()
        if cfg.num_key_value_heads < tp.world_size:
            raise ValueError(f"OLMo 2 with {cfg.num_key_value_heads} KV heads cannot run on --tensor-parallel-size "
                             f"{tp.world_size}: its k norm spans all KV heads, which would be replicated")
        q_shard, kv_shard = head_shards(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, tp)
        eps, split, dim = cfg.rms_norm_eps, tp.world_size > 1, cfg.head_dim
        self.q_norm = Olmo2RMSNorm(q_shard.size, eps, q_shard if split else None, cfg.num_attention_heads * dim)
        self.k_norm = Olmo2RMSNorm(kv_shard.size, eps, kv_shard if split else None, cfg.num_key_value_heads * dim)

    def forward(self, hidden, rope, kv_cache, meta: AttentionMetadata):
        num_tokens, ops = hidden.shape[0], self.ops
        q, k, v = ops.linear(hidden, self.qkv_proj).split(self.split, dim=-1)
        q = self.q_norm(q).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_norm(k).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = ops.rotary(q, k, rope)
        attn = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return ops.linear(attn.reshape(num_tokens, -1), self.o_proj)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden, rope, kv_cache, meta: AttentionMetadata):
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, rope, kv_cache, meta))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class Olmo2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__(cfg, backend, max_positions)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(cfg, layer.self_attn, layer.mlp) for layer in self.layers)
        self.norm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.requires_grad_(False)
        self._fused_norms = False

    def make_attention(self, layer_index: int, backend: AttentionBackend) -> nn.Module:
        return Olmo2Attention(self.cfg, backend)

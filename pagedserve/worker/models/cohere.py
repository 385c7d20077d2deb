"""Cohere's Command-R family (CohereForCausalLM: Command-R, Command-R+, Aya 23), as transformers'
CohereForCausalLM computes it: the Llama projections and SiLU MLP with

- LayerNorm (mean subtracted, no bias) in place of RMSNorm, in float32 before the cast;
- one norm a layer and the attention and the MLP in parallel on its output:
  h + attn(norm(h)) + mlp(norm(h));
- rotary on interleaved pairs of each head's dimensions (GPT-J's layout): the q and k projections'
  rows are reordered at load, each head's even dimensions then its odd ones, so the rotary of the
  ops bundle (halves) computes it exactly (q . k is the same sum in any order of the dimensions
  that both share; v and the output are untouched). A GGUF (llama.cpp's command-r and cohere2,
  whose rotary also takes interleaved pairs) holds them in HF's order too; kept quantized, its rows
  move as whole rows of blocks;
- with `use_qk_norm`, a LayerNorm over each query and key head with a weight per head (reordered
  the same way; under tensor parallelism each rank holds its heads' rows);
- the logits times `logit_scale`; tied embeddings by default.

Cohere2ForCausalLM (Command R7B) is the same layer with local and global layers interleaved (three
local to one global unless `layer_types` says): local layers attend through the backend's windowed variant
in their own KV group and take rotary; global layers take none (NoPE), as transformers' Cohere2.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.common.model_config import ModelConfig, layer_types
from pagedserve.worker.attention import AttentionBackend, AttentionMetadata
from pagedserve.worker.models.llama import LlamaAttention, LlamaForCausalLM
from pagedserve.worker.parallel import Shard, copy_checked, head_shards, mark_loader, new_param
from pagedserve.worker.process_group import tp_group
from pagedserve.worker.quantized import QuantizedTensor


def halves_order(head_dim: int) -> torch.Tensor:
    """A head's dimensions reordered from interleaved rotary pairs to halves: evens, then odds."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


class CohereLayerNorm(nn.Module):
    """transformers' CohereLayerNorm: (x - mean) / std * w in float32, no bias. shape (heads, head_dim):
    one weight row a head (the q/k norm); shard: the rows of those heads this rank holds."""

    def __init__(self, shape: int | tuple[int, int], eps: float, shard: Shard | None = None) -> None:
        super().__init__()
        self.eps, self.shard = eps, shard
        if shard is None:
            self.weight = nn.Parameter(torch.ones(shape), requires_grad=False)
        else:
            self.weight = new_param(shard.size, shape[1])
            mark_loader(self.weight, self._load, 1)

    def _load(self, param: nn.Parameter, loaded, part: int) -> None:
        copy_checked(param.data, loaded.narrow(0, self.shard.start, self.shard.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        centred = out - out.mean(-1, keepdim=True)
        out = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * out).to(x.dtype)


class CohereAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(cfg, backend)
        self.q_norm = self.k_norm = None
        if cfg.hf.get("use_qk_norm"):
            eps, dim = cfg.hf.get("layer_norm_eps", 1e-5), cfg.head_dim
            q_shard, kv_shard = head_shards(cfg.num_attention_heads, cfg.num_key_value_heads, dim, tp_group())
            self.q_norm = CohereLayerNorm((cfg.num_attention_heads, dim), eps,
                                          Shard(q_shard.start // dim, self.num_heads))
            self.k_norm = CohereLayerNorm((cfg.num_key_value_heads, dim), eps,
                                          Shard(kv_shard.start // dim, self.num_kv_heads))

    def forward(self, hidden, rope, kv_cache, meta: AttentionMetadata):
        num_tokens, ops = hidden.shape[0], self.ops
        q, k, v = self.project(hidden)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = ops.rotary(q, k, rope)
        attn = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return ops.linear(attn.reshape(num_tokens, -1), self.o_proj)


class CohereDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = CohereLayerNorm(cfg.hidden_size, cfg.hf.get("layer_norm_eps", 1e-5))

    def forward(self, hidden, rope, kv_cache, meta: AttentionMetadata):
        normed = self.input_layernorm(hidden)
        return hidden + self.self_attn(normed, rope, kv_cache, meta) + self.mlp(normed)


class CohereForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__(cfg, backend, max_positions)
        self.layers = nn.ModuleList(CohereDecoderLayer(cfg, layer.self_attn, layer.mlp) for layer in self.layers)
        self.norm = CohereLayerNorm(cfg.hidden_size, cfg.hf.get("layer_norm_eps", 1e-5))
        self.logit_scale = float(cfg.hf.get("logit_scale", 1.0))
        self.requires_grad_(False)
        self._fused_norms = False

    def make_attention(self, layer_index: int, backend: AttentionBackend) -> nn.Module:
        return CohereAttention(self.cfg, backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rope(positions, hidden.dtype)
        for i, layer in enumerate(self.layers):  # meta: one for all layers, or per layer (Cohere2's KV groups)
            hidden = layer(hidden, rope, kv_caches[i], meta[i] if isinstance(meta, list) else meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.logit_scale

    def load_weights(self, weights) -> None:
        """The checkpoint's q/k rows (and q/k norm columns) in halves order (the module docstring)."""
        cfg = self.cfg
        order = halves_order(cfg.head_dim)

        def reordered():
            for name, w in weights:
                if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                    heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
                    full = w.full()
                    rows = torch.arange(heads * cfg.head_dim).reshape(heads, cfg.head_dim)[:, order].reshape(-1)
                    # a GGUF's weight kept quantized (QuantizedTensor): whole rows of blocks move intact
                    w = full.permute_rows(rows) if isinstance(full, QuantizedTensor) else full[rows]
                elif name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                    w = w.full()[:, order]
                yield name, w
        super().load_weights(reordered())


class Cohere2ForCausalLM(CohereForCausalLM):
    def make_attention(self, layer_index: int, backend: AttentionBackend) -> nn.Module:
        hf = self.cfg.hf
        local = layer_types({**hf, "num_hidden_layers": self.cfg.num_hidden_layers})[layer_index] == "sliding_attention"
        window = hf.get("sliding_window")
        if local and window:
            if getattr(self, "_local_backend", None) is None:  # one for all local layers: one windowed mask a step
                self._local_backend = backend.variant(window=window)
            backend = self._local_backend
        attention = CohereAttention(self.cfg, backend)
        attention.use_rope = local
        return attention

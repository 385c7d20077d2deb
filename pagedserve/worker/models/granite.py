"""IBM Granite (3.x dense): the Llama skeleton with four multipliers, applied where transformers'
GraniteModel applies them: the embeddings times `embedding_multiplier`, each attention and MLP output
times `residual_multiplier` before its residual add, `attention_multiplier` as the attention's scale
(in place of 1/sqrt(head_dim)), and the logits divided by `logits_scaling`. The residual multiplier
sits between an output and its add, so the layers run unfused (GraniteDecoderLayer: the ops bundle's
norm-with-residual kernel adds the output as it is).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.worker.attention import AttentionBackend, AttentionMetadata
from pagedserve.worker.models.llama import DecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, cfg, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__(cfg, self_attn, mlp)
        self.residual_multiplier = float(cfg.hf.get("residual_multiplier", 1.0))

    def forward(self, hidden, rope, kv_cache, meta: AttentionMetadata):
        m = self.residual_multiplier
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, kv_cache, meta) * m
        return hidden + self.mlp(self.post_attention_layernorm(hidden)) * m


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__(cfg, backend, max_positions)
        self.layers = nn.ModuleList(GraniteDecoderLayer(cfg, layer.self_attn, layer.mlp) for layer in self.layers)
        self.embedding_multiplier = float(cfg.hf.get("embedding_multiplier", 1.0))
        self.logits_scaling = float(cfg.hf.get("logits_scaling", 1.0))
        self._fused_norms = False

    def make_attention(self, layer_index: int, backend: AttentionBackend) -> nn.Module:
        attention = super().make_attention(layer_index, backend)
        attention.scale = float(self.cfg.hf.get("attention_multiplier", attention.scale))
        return attention

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embedding_multiplier
        rope = self.rope(positions, hidden.dtype)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, rope, kv_caches[i], meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling

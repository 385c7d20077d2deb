"""Gemma 2 over a paged KV cache: Gemma 3's skeleton (gemma3.py: zero-centred norms, four norms a
layer, GeGLU, embeddings scaled by sqrt(hidden_size), queries by query_pre_attn_scalar ** -0.5,
local and global layers interleaved) with Gemma 2's differences:

- no q/k norms; one rope base for every layer (`rope_theta`);
- attention logits soft-capped (`attn_logit_softcapping`: cap * tanh(scores / cap), before the
  mask) in every layer: the backend's variant with a softcap (AttentionBackend.variant: on the CPU the
  torch ops, whose compiled kernels do not cap; on CUDA the Triton kernels), windowed too for the local layers;
- final logits soft-capped (`final_logit_softcapping`), as Gemma 3 may;
- the local layers are every second one from the first unless `layer_types` says otherwise.

Numerics follow transformers' Gemma2ForCausalLM (eager attention) so greedy tokens match it in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend, AttentionMetadata
from pagedserve.worker.models.gemma3 import GeGLUMLP, Gemma3DecoderLayer, Gemma3ForCausalLM, inv_freq
from pagedserve.worker.models.llama import LlamaAttention


class Gemma2Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(cfg, backend)
        self.scale = cfg.hf.get("query_pre_attn_scalar", cfg.head_dim) ** -0.5

    def forward(self, hidden, rope, kv_cache, meta: AttentionMetadata):
        num_tokens, ops = hidden.shape[0], self.ops
        q, k, v = self.project(hidden)
        q, k = ops.rotary(q, k, rope)
        attn = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return ops.linear(attn.reshape(num_tokens, -1), self.o_proj)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    def make_layers(self, backend: AttentionBackend) -> list[nn.Module]:
        cfg, hf = self.cfg, self.cfg.hf  # self.layer_types: every second layer local unless config.json says
        window, cap = hf.get("sliding_window"), hf.get("attn_logit_softcapping")
        # One backend for each kind of layer (a windowed one builds the step's windowed mask once).
        full_backend = backend.variant(softcap=cap or 0.0)
        local_backend = backend.variant(window=window, softcap=cap or 0.0) if window else full_backend
        return [Gemma3DecoderLayer(cfg, Gemma2Attention(cfg, local_backend if local else full_backend),
                                   GeGLUMLP(cfg.hidden_size, cfg.intermediate_size))
                for local in (t == "sliding_attention" for t in self.layer_types)]

    def init_rope(self, max_positions: int) -> None:
        hf = self.cfg.hf
        params = {"rope_theta": hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10_000.0)),
                  **(hf.get("rope_scaling") or {})}
        params["rope_type"] = params.get("rope_type", params.get("type", "default"))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq(params, self.cfg.head_dim))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=hidden.dtype, device=hidden.device)
        rope = self.ops.rope(self.cos_table, self.sin_table, positions, hidden.dtype)
        for i, layer in enumerate(self.layers):  # meta: one for all layers, or per layer (KV groups)
            hidden = layer(hidden, rope, kv_caches[i], meta[i] if isinstance(meta, list) else meta)
        return self.norm(hidden)

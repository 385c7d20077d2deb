"""Gemma 3 (text) over a paged KV cache: the Llama skeleton with Gemma's differences.

- layers interleave local (sliding-window) and global attention (`layer_types`, or every
  `sliding_window_pattern`-th layer global); local layers attend through the backend's windowed
  variant (AttentionBackend.variant) and use their own rope base (`rope_local_base_freq`, 10k),
  global layers the model's (1M);
- RMSNorm weights are zero-centred, applied as (1 + w), with the product taken in float32 before
  the cast (transformers' Gemma3RMSNorm); q and k are RMS-normed per head before rope;
- four norms per layer (input, post-attention, pre- and post-feedforward);
- GeGLU MLP (tanh-approximated GELU on the gate), embeddings scaled by sqrt(hidden_size),
  attention scaled by query_pre_attn_scalar ** -0.5, optional final logit soft-capping.

Numerics follow transformers' Gemma3ForCausalLM so greedy tokens match it in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.common.model_config import ModelConfig, layer_types  # noqa: F401 (re-exported)
from pagedserve.worker.attention import AttentionBackend, AttentionMetadata
from pagedserve.worker.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from pagedserve.worker.parallel import VocabParallelEmbedding
from pagedserve.worker.platform import current_platform


def rope_params(hf: dict) -> dict[str, dict]:
    """{'sliding_attention': {...}, 'full_attention': {...}} rope parameters (transformers 5's
    rope_parameters, or 4's rope_theta / rope_local_base_freq / rope_scaling)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        return {kind: dict(params[kind]) for kind in ("sliding_attention", "full_attention")}
    full = {"rope_type": "default", "rope_theta": hf.get("rope_theta", 1_000_000.0)}
    full.update(hf.get("rope_scaling") or {})
    full["rope_type"] = full.get("rope_type", full.get("type", "default"))
    return {"sliding_attention": {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10_000.0)},
            "full_attention": full}


def inv_freq(params: dict, head_dim: int) -> torch.Tensor:
    base = params["rope_theta"]
    freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params.get("rope_type", "default")
    if kind == "linear":
        return freq / params["factor"]
    if kind != "default":
        raise ValueError(f"unsupported Gemma 3 rope_type {kind!r}; supported: default, linear")
    return freq


class GemmaRMSNorm(nn.Module):
    """Zero-centred weight: x / rms(x) * (1 + w), in float32, then cast."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, is_local: bool) -> None:
        super().__init__(cfg, backend)
        self.is_local = is_local
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.hf.get("query_pre_attn_scalar", cfg.head_dim) ** -0.5

    def forward(self, hidden, ropes, kv_cache, meta: AttentionMetadata):
        num_tokens, ops = hidden.shape[0], self.ops
        q, k, v = self.project(hidden)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary(q, k, ropes[self.is_local])
        attn = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return ops.linear(attn.reshape(num_tokens, -1), self.o_proj)


class GeGLUMLP(LlamaMLP):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        return ops.linear(ops.gelu_and_mul(ops.linear(hidden, self.gate_up_proj)), self.down_proj)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, hidden, ropes, kv_cache, meta: AttentionMetadata):
        attn = self.self_attn(self.input_layernorm(hidden), ropes, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        self.ops = current_platform().ops
        hf = cfg.hf
        self.layer_types = layer_types({**hf, "num_hidden_layers": cfg.num_hidden_layers})
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layers(backend))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.softcap = hf.get("final_logit_softcapping")
        self.init_rope(max_positions)
        self.requires_grad_(False)
        self._fused_norms = False

    def make_layers(self, backend: AttentionBackend) -> list[nn.Module]:
        cfg, window = self.cfg, self.cfg.hf.get("sliding_window")
        # One windowed backend for all local layers (it builds the step's windowed mask once).
        local_backend = backend.variant(window=window or 0)
        return [Gemma3DecoderLayer(cfg, Gemma3Attention(cfg, local_backend if local else backend, local),
                                   GeGLUMLP(cfg.hidden_size, cfg.intermediate_size))
                for local in (t == "sliding_attention" for t in self.layer_types)]

    @property
    def sliding_window(self) -> int | None:
        return self.cfg.hf.get("sliding_window")

    def init_rope(self, max_positions: int) -> None:
        positions = torch.arange(max_positions, dtype=torch.float32)
        for kind, params in rope_params(self.cfg.hf).items():
            freqs = torch.outer(positions, inv_freq(params, self.cfg.head_dim))
            emb = torch.cat((freqs, freqs), dim=-1)
            prefix = "local" if kind == "sliding_attention" else "global"
            self.register_buffer(f"{prefix}_cos", emb.cos(), persistent=False)
            self.register_buffer(f"{prefix}_sin", emb.sin(), persistent=False)
        self.cos_table = self.global_cos  # the profiling step sizes positions by it

    def ropes(self, positions: torch.Tensor, dtype: torch.dtype):
        """(global, local) rope arguments, indexed by Gemma3Attention.is_local."""
        return [self.ops.rope(cos, sin, positions, dtype)
                for cos, sin in ((self.global_cos, self.global_sin), (self.local_cos, self.local_sin))]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds: the step's embeddings given, already scaled (models/gemma3_vl.py's: its image rows
        among them, unscaled), else input_ids' scaled by sqrt(hidden_size)."""
        hidden = self.embed_scaled(input_ids) if inputs_embeds is None else inputs_embeds
        ropes = self.ropes(positions, hidden.dtype)
        for i, layer in enumerate(self.layers):  # meta: one for all layers, or per layer (KV groups)
            hidden = layer(hidden, ropes, kv_caches[i], meta[i] if isinstance(meta, list) else meta)
        return self.norm(hidden)

    def embed_scaled(self, input_ids: torch.Tensor) -> torch.Tensor:
        """transformers' Gemma3TextScaledWordEmbedding: the embedding times sqrt(hidden_size) in its dtype."""
        return self.scale_embeddings(self.embed_tokens(input_ids))

    def scale_embeddings(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=hidden.dtype, device=hidden.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

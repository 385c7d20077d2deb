"""Qwen3 (dense) and Qwen3-MoE: the Qwen2 decoder without q/k/v biases and with an RMSNorm over
each query and key head (q_norm / k_norm, one weight of head_dim shared by the heads) between the
projection and the rotary embedding.

Qwen3-MoE has routed experts and no shared expert: a float32 softmax over the experts, top k,
renormalised with norm_topk_prob, the weights rounded to the activation dtype (as transformers
does); layers in `mlp_only_layers`, or off `decoder_sparse_step`, keep a dense MLP (the layer
choice is Qwen2-MoE's, inherited). Under tensor parallelism the head norms are replicated (they
act within one head), and a MoE block costs one all_reduce, as a dense MLP does.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend, AttentionMetadata
from pagedserve.worker.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm
from pagedserve.worker.models.qwen2_moe import Qwen2MoeForCausalLM
from pagedserve.worker.moe import FusedMoE, MoEBackend, softmax_topk
from pagedserve.worker.parallel import ReplicatedLinear, RowParallelLinear
from pagedserve.worker.platform import current_platform


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(cfg, backend)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        if cfg.attention_bias:  # transformers gives o_proj a bias too when attention_bias is set
            self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=True)

    def forward(self, hidden, rope, kv_cache, meta: AttentionMetadata):
        num_tokens, ops = hidden.shape[0], self.ops
        q, k, v = self.project(hidden)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary(q, k, rope)
        attn = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return ops.linear(attn.reshape(num_tokens, -1), self.o_proj)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, layer_index: int, backend: AttentionBackend) -> nn.Module:
        return Qwen3Attention(self.cfg, backend)


def qwen3_num_experts(hf: dict) -> int:
    # Qwen's own config.json says num_experts; transformers 5 saves it as num_local_experts.
    return hf.get("num_experts") or hf.get("num_local_experts") or 0


class Qwen3MoeSparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: MoEBackend) -> None:
        super().__init__()
        hf = cfg.hf
        num_experts = qwen3_num_experts(hf)
        self.top_k = hf["num_experts_per_tok"]
        self.renormalize = bool(hf.get("norm_topk_prob", True))
        self.gate = ReplicatedLinear(cfg.hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, cfg.hidden_size, hf["moe_intermediate_size"], backend)
        self.ops = current_platform().ops

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.ops.linear(hidden, self.gate), self.top_k, self.renormalize)
        weights = weights.to(hidden.dtype).float()  # transformers scales by weights in the model dtype
        return self.experts(hidden, weights, ids)  # the block's one all_reduce


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    def num_experts(self) -> int:
        return qwen3_num_experts(self.cfg.hf)

    def make_attention(self, layer_index: int, backend: AttentionBackend) -> nn.Module:
        return Qwen3Attention(self.cfg, backend)

    def make_mlp(self, layer_index: int) -> nn.Module:
        if self.is_moe_layer(layer_index):
            return Qwen3MoeSparseMoE(self.cfg, self.moe_backend)
        return LlamaMLP(self.cfg.hidden_size, self.cfg.intermediate_size)

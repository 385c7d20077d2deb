"""StarCoder2 (Starcoder2ForCausalLM), as transformers computes it: the Llama attention with biases on
q, k, v and o (`use_bias`), LayerNorm with a bias in place of RMSNorm (before attention, before the
MLP, at the end), and a plain MLP: c_fc, tanh-approximated GELU, c_proj, both with biases. Its
`sliding_window`, when set, applies to every layer: ModelConfig caps the context at it (below the
window windowed and full attention are the same). Embeddings tied by default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.models.llama import LlamaAttention, LlamaForCausalLM
from pagedserve.worker.parallel import ColumnParallelLinear, RowParallelLinear, even_shard
from pagedserve.worker.platform import current_platform


class LayerNorm(nn.Module):
    """torch's LayerNorm with a bias (weights loaded from the checkpoint)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Starcoder2MLP(nn.Module):
    """c_fc column-parallel, GELU (tanh), c_proj row-parallel; biases when `use_bias`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        bias = bool(cfg.hf.get("use_bias", True))
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, [even_shard(cfg.intermediate_size)], bias=bias)
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.ops = current_platform().ops

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        return ops.linear(F.gelu(ops.linear(hidden, self.c_fc), approximate="tanh"), self.c_proj)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__(cfg, backend, max_positions)
        eps = cfg.hf.get("norm_epsilon", 1e-5)
        for layer in self.layers:
            layer.input_layernorm = LayerNorm(cfg.hidden_size, eps)
            layer.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps)
        self.norm = LayerNorm(cfg.hidden_size, eps)
        self.requires_grad_(False)
        self._fused_norms = False

    def make_attention(self, layer_index: int, backend: AttentionBackend) -> nn.Module:
        attention = LlamaAttention(self.cfg, backend)
        if self.cfg.hf.get("use_bias", True):
            attention.o_proj = RowParallelLinear(self.cfg.num_attention_heads * self.cfg.head_dim,
                                                 self.cfg.hidden_size, bias=True)
        return attention

    def make_mlp(self, layer_index: int) -> nn.Module:
        return Starcoder2MLP(self.cfg)

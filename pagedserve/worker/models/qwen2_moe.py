"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): routed experts plus one always-on shared expert whose
output is scaled by sigmoid(shared_expert_gate(x)); q/k/v carry biases. Routing is a float32
softmax over the experts, top k, renormalised only with norm_topk_prob, and the weights are then
rounded to the activation dtype (as transformers does). Layers in `mlp_only_layers`, or with
(i + 1) % decoder_sparse_step != 0, keep a dense MLP of `intermediate_size`.

Under tensor parallelism the routed experts and the shared expert each leave a partial sum on
every rank; the shared-expert gate is replicated, so scaling the partial is exact, and the block
adds the two partials and needs one all_reduce in all.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.models.llama import MERGED_PROJECTIONS, LlamaAttention, LlamaMLP
from pagedserve.worker.models.mixtral import MoEForCausalLM
from pagedserve.worker.moe import FusedMoE, MoEBackend, softmax_topk
from pagedserve.worker.parallel import ReplicatedLinear
from pagedserve.worker.process_group import all_reduce
from pagedserve.worker.platform import current_platform


class Qwen2MoeSparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: MoEBackend) -> None:
        super().__init__()
        hf, hidden = cfg.hf, cfg.hidden_size
        num_experts = hf["num_experts"]
        self.top_k = hf["num_experts_per_tok"]
        self.renormalize = bool(hf.get("norm_topk_prob", False))
        self.gate = ReplicatedLinear(hidden, num_experts)
        self.experts = FusedMoE(num_experts, hidden, hf["moe_intermediate_size"], backend, reduce=False)
        self.shared_expert = LlamaMLP(hidden, hf["shared_expert_intermediate_size"], reduce=False)
        self.shared_expert_gate = ReplicatedLinear(hidden, 1)
        self.ops = current_platform().ops

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        weights, ids = softmax_topk(ops.linear(hidden, self.gate), self.top_k, self.renormalize)
        weights = weights.to(hidden.dtype).float()  # transformers scales by weights in the model dtype
        out = self.experts(hidden, weights, ids)  # this rank's partial sum
        shared = self.shared_expert(hidden)  # partial too (down projection unreduced)
        out = out + torch.sigmoid(ops.linear(hidden, self.shared_expert_gate)) * shared
        return all_reduce(out)


class Qwen2MoeForCausalLM(MoEForCausalLM):
    moe_module = "mlp"

    def num_experts(self) -> int:
        return self.cfg.hf.get("num_experts") or 0

    def is_moe_layer(self, layer_index: int) -> bool:
        hf = self.cfg.hf
        return (layer_index not in (hf.get("mlp_only_layers") or []) and self.num_experts() > 0
                and (layer_index + 1) % hf.get("decoder_sparse_step", 1) == 0)

    def make_attention(self, layer_index: int, backend: AttentionBackend) -> nn.Module:
        # transformers 5 reads qkv_bias (default on); older configs lack it and always had biases.
        cfg = dataclasses.replace(self.cfg, attention_bias=bool(self.cfg.hf.get("qkv_bias", True)))
        return LlamaAttention(cfg, backend)

    def make_mlp(self, layer_index: int) -> nn.Module:
        if self.is_moe_layer(layer_index):
            return Qwen2MoeSparseMoE(self.cfg, self.moe_backend)
        return LlamaMLP(self.cfg.hidden_size, self.cfg.intermediate_size)

    def map_name(self, name: str) -> tuple[str, object] | None:
        if ".mlp." in name and name.startswith("model."):
            short = name[len("model."):]
            expert = self.map_expert_name(short)
            if expert is not None:
                return expert
            for proj, (merged, part) in MERGED_PROJECTIONS.items():
                if f".mlp.shared_expert.{proj}." in short:
                    head, _, tail = short.partition(f".{proj}.")
                    return f"{head}.{merged}.{tail}", part
        return super().map_name(name)

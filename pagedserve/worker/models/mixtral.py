"""Mixtral: the Llama decoder with every MLP replaced by routed experts (softmax over the experts
in float32, top k, renormalised to sum to 1), and the MoE plumbing Qwen2-MoE shares with it.

Tensor parallelism splits each expert by intermediate size (moe.FusedMoE); the router is
replicated, so every rank picks the same experts and a MoE block costs one all_reduce, as a dense
MLP does.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.moe import FusedMoE, MoEBackend, expert_part, softmax_topk
from pagedserve.worker.parallel import ReplicatedLinear, load_model_weights
from pagedserve.worker.platform import current_platform


class MixtralSparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: MoEBackend) -> None:
        super().__init__()
        num_experts = cfg.hf["num_local_experts"]
        self.top_k = cfg.hf["num_experts_per_tok"]
        self.gate = ReplicatedLinear(cfg.hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, cfg.hidden_size, cfg.intermediate_size, backend)
        self.ops = current_platform().ops

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.ops.linear(hidden, self.gate), self.top_k, renormalize=True)
        return self.experts(hidden, weights, ids)  # the block's one all_reduce


class MoEForCausalLM(LlamaForCausalLM):
    """The MoE decoders' common part: the experts' compute backend (the platform's: Triton on CUDA,
    the grouped torch loop on the CPU; or `moe_backend`), HF expert names mapped to FusedMoE parts, and a
    loader that names the expert tensors a checkpoint lacks."""

    moe_module = ""  # the MoE block's name in a checkpoint layer: "block_sparse_moe" / "mlp"
    expert_projections = ("gate_proj", "up_proj", "down_proj")  # per-expert gate, up, down names

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 moe_backend: MoEBackend | None = None) -> None:
        # Set before nn.Module.__init__ runs make_mlp (a plain attribute, not a submodule).
        self.moe_backend = moe_backend or current_platform().moe_backend()
        super().__init__(cfg, backend, max_positions)

    def is_moe_layer(self, layer_index: int) -> bool:
        return True

    def num_experts(self) -> int:
        raise NotImplementedError

    def map_expert_name(self, name: str) -> tuple[str, object] | None:
        """'layers.3.<moe_module>.experts.5.<proj>.weight' -> ('layers.3.mlp.experts.w13', (5, 0)),
        or None when the name is not a routed expert's."""
        head, sep, tail = name.partition(f".{self.moe_module}.experts.")
        if not sep:
            return None
        unknown = f"{head}.mlp.experts.{tail}", 0  # no such parameter: load_model_weights names the tensor
        expert = tail.split(".", 1)[0]
        if tail.count(".") != 2 or not tail.endswith(".weight") or not expert.isdigit():
            return unknown
        if int(expert) >= self.num_experts():
            return unknown
        try:
            param, part = expert_part(tail, *self.expert_projections)
        except ValueError:  # a projection name this model does not have
            return unknown
        return f"{head}.mlp.experts.{param}", part

    def expert_weight_names(self) -> list[str]:
        gate, up, down = self.expert_projections
        return [f"model.layers.{i}.{self.moe_module}.experts.{e}.{proj}.weight"
                for i in range(self.cfg.num_hidden_layers) if self.is_moe_layer(i)
                for e in range(self.num_experts()) for proj in (gate, up, down)]

    def load_weights(self, weights) -> None:
        seen: set[str] = set()
        exhausted = []

        def tracked():
            for name, weight in weights:
                seen.add(name)
                yield name, weight
            exhausted.append(True)

        try:
            load_model_weights(self, tracked(), self.map_name)
        except ValueError:
            # A checkpoint read to its end that still lacks parameters: say which experts.
            missing = [n for n in self.expert_weight_names() if n not in seen] if exhausted else []
            if not missing:
                raise
            shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
            raise ValueError(f"the checkpoint lacks {len(missing)} expert weight(s): {shown}") from None


class MixtralForCausalLM(MoEForCausalLM):
    moe_module = "block_sparse_moe"
    expert_projections = ("w1", "w3", "w2")

    def num_experts(self) -> int:
        return self.cfg.hf["num_local_experts"]

    def make_mlp(self, layer_index: int) -> nn.Module:
        return MixtralSparseMoE(self.cfg, self.moe_backend)

    def map_name(self, name: str) -> tuple[str, object] | None:
        if f".{self.moe_module}." in name and name.startswith("model."):
            name = name[len("model."):]
            expert = self.map_expert_name(name)
            if expert is not None:
                return expert
            return name.replace(f".{self.moe_module}.", ".mlp.", 1), 0  # the router: .gate.weight
        return super().map_name(name)

"""Mixture-of-experts: routing functions, the routed-experts layer and its compute backends.

Tensor parallelism splits every expert by its intermediate size (each rank holds a column slice
of all experts' gate/up and the matching rows of down), not whole experts across ranks: every
rank then does the same work however skewed the routing is, needs no all-to-all token dispatch,
and ends with the single all_reduce a dense MLP needs — which the shared experts' partial sum
joins. Expert parallelism pays off with many ranks and hundreds of experts, where a per-rank
slice of each expert gets too thin for an efficient matmul; the backends already accept -1 for
"expert not on this rank" so it can be added without touching them.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.worker.parallel import mark_loader, new_param, copy_checked, even_shard
from pagedserve.worker.process_group import all_reduce


# ---- routing --------------------------------------------------------------------------------
def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen2-MoE: softmax over all experts (float32), keep the top k, optionally
    rescale them to sum to 1. Returns (weights float32 [T, k], expert ids int64 [T, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk(router_logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int,
                 scoring: str = "sigmoid", correction_bias: torch.Tensor | None = None,
                 renormalize: bool = True, routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek: score experts (sigmoid for V3, softmax for V2), add the load-balancing bias for
    the choice only, keep the `topk_groups` expert groups whose best scores are highest (V3: sum
    of each group's top two; V2: the group's maximum), pick the top k experts inside them; weights
    are the unbiased scores, optionally renormalised, times the routed scaling factor."""
    logits = router_logits.float()
    scores = logits.sigmoid() if scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    num_tokens, num_experts = scores.shape
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
        if correction_bias is not None:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = torch.topk(group_scores, topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


# ---- compute backends -----------------------------------------------------------------------
class MoEBackend(abc.ABC):
    """Contract: `forward(hidden [T, Hd], w13 [E, 2I, Hd] (gate rows, then up rows), w2 [E, Hd, I],
    topk_weights [T, k] float32, topk_ids [T, k] int64)` returns [T, Hd] in hidden's dtype:
    sum over the k slots of weight * w2[e] @ (silu(gate_e x) * up_e x). An id of -1 means the
    expert is not on this rank and contributes nothing."""

    @abc.abstractmethod
    def forward(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor: ...


class GroupedTorchMoE(MoEBackend):
    """The (token, slot) pairs sorted by expert once; then one gate/up and one down matmul per
    expert over its contiguous rows, and one scatter-add back. A Python loop over experts, never
    over tokens."""

    def forward(self, hidden, w13, w2, topk_weights, topk_ids):
        num_tokens, top_k = topk_ids.shape
        num_experts = w13.shape[0]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids + 1, minlength=num_experts + 1).tolist()  # slot 0: the -1 ids
        token_of_row = order // top_k
        rows = hidden.index_select(0, token_of_row)
        out = torch.zeros_like(rows)
        start = counts[0]
        for expert, count in enumerate(counts[1:]):
            if count:
                block = slice(start, start + count)
                gate, up = F.linear(rows[block], w13[expert]).chunk(2, dim=-1)
                out[block] = F.linear(F.silu(gate) * up, w2[expert])
                start += count
        scale = topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
        result = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        result.index_add_(0, token_of_row, out.float() * scale)
        return result.to(hidden.dtype)


class NaiveTorchMoE(MoEBackend):
    """One token at a time, one expert at a time: the baseline the benchmark compares against."""

    def forward(self, hidden, w13, w2, topk_weights, topk_ids):
        result = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        for token, (weights, ids) in enumerate(zip(topk_weights.tolist(), topk_ids.tolist())):
            for weight, expert in zip(weights, ids):
                if expert < 0:
                    continue
                gate, up = F.linear(hidden[token], w13[expert]).chunk(2, dim=-1)
                result[token] += weight * F.linear(F.silu(gate) * up, w2[expert]).float()
        return result.to(hidden.dtype)


class TritonMoE(MoEBackend):
    """pagedserve/kernels/triton's fused MoE: tokens sorted and padded by expert, one grouped matmul launch
    over all experts for gate/up and one for down (CUDA)."""

    def forward(self, hidden, w13, w2, topk_weights, topk_ids):
        from pagedserve.kernels.triton.fused_moe import fused_moe
        return fused_moe(hidden, w13, w2, topk_weights, topk_ids)


class FusedMoE(nn.Module):
    """One layer's routed experts, all in two stacked tensors: w13 [E, 2*I/tp, Hd] and
    w2 [E, Hd, I/tp]. Routing is the caller's (it differs per model). Checkpoint names map to
    parts (expert, 0 = gate | 1 = up) of w13 and (expert,) of w2."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: MoEBackend,
                 reduce: bool = True) -> None:
        super().__init__()
        self.shard = even_shard(intermediate_size)
        self.backend, self.reduce = backend, reduce
        self.w13 = new_param(num_experts, 2 * self.shard.size, hidden_size)
        self.w2 = new_param(num_experts, hidden_size, self.shard.size)
        mark_loader(self.w13, self._load_w13, 2 * num_experts)
        mark_loader(self.w2, self._load_w2, num_experts)

    def _load_w13(self, param, loaded, part) -> None:
        expert, which = part
        size = self.shard.size
        copy_checked(param.data[expert, which * size:(which + 1) * size], loaded.narrow(0, self.shard.start, size))

    def _load_w2(self, param, loaded, part) -> None:
        copy_checked(param.data[part], loaded.narrow(1, self.shard.start, self.shard.size))

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = self.backend.forward(hidden, self.w13, self.w2, topk_weights, topk_ids)
        return all_reduce(out) if self.reduce else out


def expert_part(tail: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"):
    """'3.gate_proj.weight' -> ('w13', (3, 0)); the per-expert checkpoint names (HF layout) to
    FusedMoE parts. Mixtral calls its projections w1 (gate), w3 (up), w2 (down)."""
    expert, proj, _ = tail.split(".", 2)
    index = int(expert)
    if proj == gate:
        return "w13", (index, 0)
    if proj == up:
        return "w13", (index, 1)
    if proj == down:
        return "w2", index
    raise ValueError(f"unknown expert projection {proj!r}")

"""The LoRA delta of one linear layer for a whole step, every adapter at once.

A LoraLayer holds, for each of `max_loras` slots, the A and the scaled B of each part of the
layer (a merged q/k/v or gate/up layer has 3 or 2 parts; a part an adapter does not adapt is
zeros), ranks padded to --max-lora-rank:

    a   [slots, parts, r, in]         (TP: a row-parallel layer's input columns only)
    b_t [parts][slots * r, out_part]  scaling * B^T (TP: a column-parallel part's output rows only)

A step's `LoraBatch` says which slot each row uses (none: the base model). The grouped matmul
(Punica's SGMV idea, in dense form for torch) is then, over the first k slots in use:

    v = x @ a[:k]^T              [T, k * parts * r]   one matmul: every slot's shrink at once
    v *= row_mask                each row keeps only its own slot's columns (zero for base rows)
    out[:, part] += v[:, :, part] @ b_t[part][:k * r]    one matmul per part

which is exactly out_row += scaling * (x_row @ A_slot^T) @ B_slot^T, since the other slots'
columns are zero. The ops bundle (worker/ops.py) calls `grouped_delta` after the base matmul,
whatever computed it (packed float, small-row kernel, quantized blocks); the CPU kernels' bundle
calls `packed_delta` instead (kernels/cpu/lora_delta.cpp: each row only its own slot's shrink and
expand, in one pass, on a packed copy of the stacks: packed.py), and CUDA's `kernel_delta`, the
Triton kernels (kernels/triton/lora.py) on the same stacks.

Tensor parallelism: a column-parallel layer's x is whole, its B rows sharded: each rank adds its
rows' delta. A row-parallel layer's x and A are sharded by input column: the shrink is a partial
sum, all-reduced ([T, k * r] values) before the expand when the layer's output was reduced.

Written by the manager between steps, read during the forward: the torch thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.worker import parallel, process_group
from pagedserve.worker.lora.packed import PackedStacks, packable


@dataclass(slots=True)
class LoraBatch:
    """One step's rows -> slots, shared by every LoraLayer. mask None: no row has an adapter
    (the layers add nothing)."""
    mask: torch.Tensor | None = None  # [T, k] activation dtype: 1 where row t uses slot s < k
    row_slots: torch.Tensor | None = None  # [T] int32: each row's slot, -1 for none (the kernels')
    slots: int = 0  # k: the slots in use are 0..k-1


class LoraLayer:
    def __init__(self, layer, parts: list[tuple[int, int]], in_features: int, max_loras: int, max_rank: int,
                 batch: LoraBatch, dtype: torch.dtype, device: torch.device) -> None:
        self.parts = parts  # (offset, size) of each part in the layer's output
        self.in_features = in_features
        self.rank = max_rank
        self.batch = batch
        self.row_parallel = isinstance(layer, parallel.RowParallelLinear)
        self.reduced = self.row_parallel and layer.reduce  # the base output is already summed over ranks
        self.a = torch.zeros(max_loras, len(parts), max_rank, in_features, dtype=dtype, device=device)
        self.b_t = [torch.zeros(max_loras * max_rank, size, dtype=dtype, device=device) for _, size in parts]
        self.packed: PackedStacks | None = None  # the CPU kernel's copy, made when it first runs

    def set_slot(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Put one adapter's parts in a slot: part -> (A [r, in], scaled B [out_part, r]), ranks
        up to max_rank; missing parts (or weights None: an empty slot) are zeros."""
        r = self.rank
        self.a[slot].zero_()
        for b_t in self.b_t:
            b_t[slot * r:(slot + 1) * r].zero_()
        for part, (a, b) in (weights or {}).items():
            rank = a.shape[0]
            self.a[slot, part, :rank].copy_(a)
            self.b_t[part][slot * r:slot * r + rank].copy_(b.t())
        if self.packed is not None:
            self.packed.write(self, slot)

    def grouped_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + every row's adapter delta (in place where out allows it), torch matmuls."""
        batch = self.batch
        k, r, num_parts = batch.slots, self.rank, len(self.parts)
        rows = x.reshape(-1, self.in_features)
        v = rows @ self.a[:k].view(k * num_parts * r, self.in_features).t()
        if self.reduced:
            process_group.all_reduce(v)
        v = v.view(-1, k, num_parts, r).mul_(batch.mask.view(-1, k, 1, 1))
        flat = out.view(-1, out.shape[-1])
        for part, (offset, size) in enumerate(self.parts):
            target = flat if num_parts == 1 else flat[:, offset:offset + size]
            target.addmm_(v[:, :, part].reshape(-1, k * r), self.b_t[part][:k * r])
        return out

    def packed_delta(self, x: torch.Tensor, out: torch.Tensor, kernels) -> torch.Tensor:
        """The same delta through the CPU kernel (kernels.lora_delta_), in place in out; the torch
        path where the kernel does not take the layer (packed.packable) or the tensors."""
        rows = x.reshape(-1, self.in_features)
        if not packable(self, x.dtype) or out.stride(-1) != 1 or out.dtype != x.dtype:
            return self.grouped_delta(x, out)
        if self.packed is None:
            self.packed = PackedStacks(self)
        p = self.packed
        kernels.lora_delta_(out.view(-1, out.shape[-1]), rows if rows.stride(-1) == 1 else rows.contiguous(),
                            p.a, p.b, self.batch.row_slots, p.rank_stride, p.offsets, p.sizes)
        return out

    def kernel_delta(self, x: torch.Tensor, out: torch.Tensor, kernels) -> torch.Tensor:
        """The same delta through the per-row kernels (kernels/triton/lora.py: each row reads its
        own slot's tiles; base rows skip), one shrink and one expand per part."""
        batch = self.batch
        k, r, num_parts = batch.slots, self.rank, len(self.parts)
        rows = x.reshape(-1, self.in_features)
        v = kernels.sgmv_shrink(rows if rows.stride(-1) == 1 else rows.contiguous(),
                                self.a[:k].view(k, num_parts * r, self.in_features), batch.row_slots)
        if self.reduced:
            process_group.all_reduce(v)
        flat = out.view(-1, out.shape[-1])
        for part, (offset, size) in enumerate(self.parts):
            kernels.sgmv_expand_(flat, v, self.b_t[part][:k * r].view(k, r, size), batch.row_slots, part * r, offset)
        return out

"""A LoraLayer's stacks in the layout the CPU kernel reads (kernels/cpu/lora_delta.cpp), kept
beside the torch stacks once the CPU kernel first runs on the layer.

A unit is 32 bits: one float32, or two bfloat16 adjacent along the reduced dimension (W = 1 or 2),
so that one 64-byte load holds 16 output columns of one unit:

    a [slots, in / W, C]   column c = part * R + j: A_part's row j (R: the rank padded to W,
                           C: parts * R padded to 16; padding is zeros)
    b [slots, R / W, N]    column n of the layer's output (its part's scaled B^T row)

Written by LoraLayer.set_slot (the manager, between steps), read during the forward: the torch
thread only.
"""

from __future__ import annotations

import torch

from pagedserve.worker import process_group

MAX_COLUMNS = 1024  # the kernel's bound on C (its per-tile buffer)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def packable(layer, dtype: torch.dtype) -> bool:
    """Whether the kernel takes this layer: float32 or bfloat16 (an even input size), shrink
    columns within MAX_COLUMNS, and no all-reduce between shrink and expand (a reduced
    row-parallel layer's shrink is a partial sum over more than one rank)."""
    if (layer.reduced and process_group.tp_group().world_size > 1) or dtype not in (torch.float32, torch.bfloat16):
        return False
    w = 2 if dtype == torch.bfloat16 else 1
    return layer.in_features % w == 0 and len(layer.parts) * _round_up(layer.rank, w) <= MAX_COLUMNS


class PackedStacks:
    def __init__(self, layer) -> None:
        dtype = layer.a.dtype
        self.w = w = 2 if dtype == torch.bfloat16 else 1
        slots = layer.a.shape[0]
        self.rank_stride = _round_up(layer.rank, w)
        columns = _round_up(len(layer.parts) * self.rank_stride, 16)
        n = max(offset + size for offset, size in layer.parts)
        self.offsets = [offset for offset, _ in layer.parts]
        self.sizes = [size for _, size in layer.parts]
        self._a = torch.zeros(slots, layer.in_features // w, columns, w, dtype=dtype)
        self._b = torch.zeros(slots, self.rank_stride // w, n, w, dtype=dtype)
        self.a = self._a.view(torch.int32).squeeze(-1)  # the kernel's views: 32-bit units
        self.b = self._b.view(torch.int32).squeeze(-1)
        for slot in range(slots):
            self.write(layer, slot)

    def write(self, layer, slot: int) -> None:
        """Slot `slot` of the layer's torch stacks, packed."""
        w, r, rs = self.w, layer.rank, self.rank_stride
        parts = len(layer.parts)
        a = torch.zeros(parts, rs, layer.in_features, dtype=layer.a.dtype)
        a[:, :r] = layer.a[slot]
        self._a[slot, :, :parts * rs] = a.view(parts * rs, -1, w).permute(1, 0, 2)
        for part, (offset, size) in enumerate(layer.parts):
            b = torch.zeros(rs, size, dtype=layer.a.dtype)
            b[:r] = layer.b_t[part][slot * r:(slot + 1) * r]
            self._b[slot, :, offset:offset + size] = b.view(rs // w, w, size).permute(0, 2, 1)

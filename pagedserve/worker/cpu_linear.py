"""Weight matmuls on the CPU with each weight prepared once, at load, for the kernel that runs it.

F.linear hands a plain [out, in] weight to MKL (float32) or oneDNN (bfloat16) on every call, and
the library re-blocks it for its kernel each time; at the row counts of a decode step that
re-blocking costs as much as the arithmetic. `pack_model` keeps, beside every linear layer's
weight, a `PackedWeight`:
  - float32: the weight in oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`),
    run through `_linear_pointwise`. Measured on a 2-core AMD EPYC (avx512_bf16), one thread,
    model shapes K=576..1536, N=576..3072: 1.05-2x faster than F.linear, most at 1-16 rows.
  - bfloat16 on a CPU with avx512_bf16: the weight's element pairs interleaved for our
    `bf16_linear` kernel (kernels/cpu/bf16_linear.cpp), which beat oneDNN at every row count of
    the default model's layers on that EPYC (2.1x at 1 row, 1.3-1.5x at 16-64, 1.02x at 512;
    docs/performance.md), so there oneDNN's copy is not kept. With AMX, oneDNN's AMX kernels
    win once there are rows enough to compute on: both copies, ours up to AMX_PAIR_ROWS rows.
  - bfloat16 without avx512_bf16: oneDNN's layout, as float32.

Only on the CPU, only for float32 and bfloat16, only when this torch has the oneDNN ops; CUDA and
everything else keep F.linear. The packed copy costs the weights' size again in memory (the plain
weight stays: tensor-parallel loading, the small-row float32 kernel and weight accounting read it).
Set once at load, read-only afterwards: safe from any thread.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

# oneDNN keeps a compiled primitive per (shape, row count) it has seen, 1,024 by default; a step's
# row count varies from 1 to the token budget, so a long-running worker filled that cache and its
# RSS grew ~190 MiB over the soak test (tests/stack/test_soak.py; 128 entries: ~160 MiB, 32:
# 100-120 MiB). 16 primitives (the five weight shapes of a layer at the row counts of the last few
# steps: a steady decode batch always hits) kept it near 80 MiB. Read by oneDNN once, at its first
# primitive: set here, on import, before any model is packed; a value in the environment wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype not in PACKED_DTYPES or os.environ.get("PAGEDSERVE_NO_PACKED_LINEAR"):
        return False
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise") \
        and hasattr(ops, "_reorder_linear_weight")


# Up to this many rows, bf16_linear on an AMX CPU: there its streaming of the weights is what a
# small-row step waits on, and past a few rows AMX's arithmetic (~1.4 TFLOP/s a core on the Xeon
# of docs/performance.md against ~0.2 for vdpbf16ps) wins. Not measured on AMX yet: a guess at the
# crossover, on the safe side.
AMX_PAIR_ROWS = 8


@dataclass(slots=True, frozen=True)
class PackedWeight:
    """One linear weight [out_features, in] prepared at load. At least one layout is present."""
    out_features: int
    onednn: torch.Tensor | None  # oneDNN's blocked layout, for `_linear_pointwise`
    pairs: torch.Tensor | None  # pack_bf16_weight's layout, for bf16_linear
    pair_rows: int  # inputs of at most this many rows go to bf16_linear (when `pairs` is set)


def pack(weight: torch.Tensor) -> PackedWeight:
    """The weight's PackedWeight for this CPU (see the module docstring)."""
    weight = weight.detach()
    pairs, pair_rows = None, 0
    ops = _pair_kernel() if weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 else None
    if ops is not None:
        pairs = ops.pack_bf16_weight(weight)
        pair_rows = AMX_PAIR_ROWS if _has_amx() else 1 << 62
    onednn = None if pair_rows > AMX_PAIR_ROWS else torch.ops.mkldnn._reorder_linear_weight(weight)
    return PackedWeight(weight.shape[0], onednn, pairs, pair_rows)


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias), weight given as `pack(weight)`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if packed.pairs is not None and rows <= packed.pair_rows and x.dtype == torch.bfloat16:
        flat = x.reshape(rows, x.shape[-1])
        out = _pair_kernel().bf16_linear(flat if flat.stride(-1) == 1 else flat.contiguous(), packed.pairs,
                                         packed.out_features)
        out = out.view(*x.shape[:-1], packed.out_features)
        return out if bias is None else out + bias
    return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")


@cache
def _pair_kernel():
    """The compiled CPU kernels when they have bf16_linear (avx512_bf16), else None."""
    if os.environ.get("PAGEDSERVE_NO_BF16_LINEAR"):
        return None
    from pagedserve.kernels import cpu_ops
    ops = cpu_ops.load()
    return ops if ops is not None and ops.bf16_linear_available() else None


@cache
def _has_amx() -> bool:
    try:
        return any(line.startswith("flags") and " amx_bf16" in line
                   for line in Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return False


def pack_model(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Pack every linear layer's weight (and the LM head's) that can be; returns how many were.
    A layer opts in by having a `packed` attribute (None until packed) and a 2-D `weight`."""
    if not available(device, dtype):
        return 0
    from pagedserve.worker.parallel import VocabParallelEmbedding

    # An embedding table is a matmul weight only as the LM head (tied or not).
    head = getattr(model, "lm_head", None) or getattr(model, "embed_tokens", None)
    count = 0
    for module in model.modules():
        if not hasattr(module, "packed") or (isinstance(module, VocabParallelEmbedding) and module is not head):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != dtype or not weight.numel():
            continue
        module.packed = pack(weight)
        count += 1
    log.info("packed %d weight matrices (%s)", count, dtype)
    return count

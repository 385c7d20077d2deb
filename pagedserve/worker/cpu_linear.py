"""Weight matmuls on the CPU with each weight prepared once, at load, for the kernel that runs it.

F.linear hands a plain [out, in] weight to MKL (float32) or oneDNN (bfloat16) on every call, and
the library re-blocks it for its kernel each time; at the row counts of a decode step that
re-blocking costs as much as the arithmetic. `pack_model` keeps, beside every linear layer's
weight, a `PackedWeight`:
  - on an AVX-512 CPU: the weight packed 16 output columns to a vector for our `lane_linear`
    kernel (kernels/cpu/lane_linear.cpp). On a 2-core AMD EPYC it beat oneDNN at every row
    count of the default model's layers (bfloat16: 2.1x at 1 row, 1.3-1.6x at 8-64, 1.02x at
    512; float32: see docs/performance.md), so there oneDNN's copy is not kept. Without
    avx512_bf16 the kernel widens bfloat16 weights in registers and multiplies in float32:
    1.7-4.7x oneDNN's bfloat16 there (an AVX-512 Xeon, docs/performance.md). With AMX,
    oneDNN's bfloat16 AMX kernels win once there are rows enough to compute on: both copies,
    ours up to AMX_LANE_ROWS rows.
  - otherwise: the weight in oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`),
    run through `_linear_pointwise` (1.05-2x faster than F.linear at the model's shapes).

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

import torch
from torch import nn

from pagedserve.worker.embedding_table import is_matmul_weight, lm_head

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
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
            and hasattr(ops, "_reorder_linear_weight")):
        return False
    # oneDNN refuses to reorder a bfloat16 weight without avx512bw/vl/dq or avx_ne_convert (an
    # AVX2-only CPU: "bf16 path needs the cpu support ..."): there bfloat16 weights are widened to
    # float32 for the float32 lane kernel (`pack`), or, without it, stay on F.linear.
    return dtype != torch.bfloat16 or _onednn_bf16() or _lane_kernel(False) is not None


@cache
def _onednn_bf16() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True


# Up to this many rows, bfloat16 goes to lane_linear on an AMX CPU: there its streaming of the
# weights is what a small-row step waits on, and past a few rows AMX's arithmetic (~1.4 TFLOP/s a
# core on the Xeon of docs/performance.md against ~0.2 for vdpbf16ps) wins. Not measured on AMX
# yet: a guess at the crossover, on the safe side.
AMX_LANE_ROWS = 8
EVERY_ROW_COUNT = 1 << 62


@dataclass(slots=True, frozen=True)
class PackedWeight:
    """One linear weight [out_features, in] prepared at load. At least one layout is present."""
    out_features: int
    onednn: torch.Tensor | None  # oneDNN's blocked layout, for `_linear_pointwise`
    lanes: torch.Tensor | None  # pack_lane_weight's layout, for lane_linear
    lane_rows: int  # inputs of at most this many rows go to lane_linear (when `lanes` is set)
    widened: bool = False  # a bfloat16 weight whose lanes are float32 (see `pack`)


def pack(weight: torch.Tensor) -> PackedWeight:
    """The weight's PackedWeight for this CPU (see the module docstring)."""
    weight = weight.detach()
    bf16 = weight.dtype == torch.bfloat16
    if bf16 and _lane_kernel(True) is None and not _onednn_bf16():
        # A CPU without bfloat16 arithmetic in our kernels or oneDNN (AVX2 only): torch's own
        # bfloat16 matmul there ran 40-400x slower than float32, and its rounding moved greedy text
        # (tests/test_bf16_text.py). A float32 copy for the float32 lane kernel: float32 speed
        # and accumulation, bfloat16 out, 2x the bfloat16 weight's memory more.
        return PackedWeight(weight.shape[0], None, _lane_kernel(False).pack_lane_weight(weight.float()),
                            EVERY_ROW_COUNT, widened=True)
    lanes, lane_rows = None, 0
    ops = _lane_kernel(bf16) if not (bf16 and weight.shape[1] % 2) else None
    if ops is not None:
        lanes = ops.pack_lane_weight(weight)
        lane_rows = AMX_LANE_ROWS if bf16 and _has_amx() else EVERY_ROW_COUNT
    onednn = None if lane_rows == EVERY_ROW_COUNT else torch.ops.mkldnn._reorder_linear_weight(weight)
    return PackedWeight(weight.shape[0], onednn, lanes, lane_rows)


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias), weight given as `pack(weight)`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if packed.lanes is not None and rows <= packed.lane_rows:
        flat = x.reshape(rows, x.shape[-1])
        if packed.widened:
            out = _lane_kernel(False).lane_linear(flat.float(), packed.lanes, packed.out_features).to(x.dtype)
        else:
            out = _lane_kernel(x.dtype == torch.bfloat16).lane_linear(
                flat if flat.stride(-1) == 1 else flat.contiguous(), packed.lanes, packed.out_features)
        out = out.view(*x.shape[:-1], packed.out_features)
        return out if bias is None else out + bias
    return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")


@cache
def _lane_kernel(bfloat16: bool):
    """The compiled CPU kernels when they have lane_linear for this dtype, else None."""
    if os.environ.get("PAGEDSERVE_NO_LANE_LINEAR"):
        return None
    from pagedserve.kernels import cpu_ops
    ops = cpu_ops.load()
    return ops if ops is not None and ops.lane_linear_available(bfloat16) else None


def _has_amx() -> bool:
    from pagedserve.kernels.cpu_ops import cpu_flags
    return " amx_bf16" in cpu_flags()


def pack_model(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Pack every linear layer's weight (and the LM head's) that can be; returns how many were.
    A layer opts in by having a `packed` attribute (None until packed) and a 2-D `weight`."""
    if not available(device, dtype):
        return 0
    head = lm_head(model)
    count = 0
    for module in model.modules():
        if not hasattr(module, "packed") or not is_matmul_weight(module, head):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != dtype or not weight.numel():
            continue
        module.packed = pack(weight)
        count += 1
    log.info("packed %d weight matrices (%s)", count, dtype)
    return count

"""Weight matmuls on the CPU through oneDNN with each weight reordered once, at load.

F.linear hands a plain [out, in] weight to MKL (float32) or oneDNN (bfloat16) on every call, and
the library re-blocks it for its kernel each time; at the row counts of a decode step that
re-blocking costs as much as the arithmetic. `pack_model` keeps, beside every linear layer's
weight, the same weight in oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`),
and the layers' forward then call `_linear_pointwise` on it. Measured on a 2-core AMD EPYC
(avx512_bf16), one thread, model shapes K=576..1536, N=576..3072: 1.05-2x faster than F.linear in
bfloat16 and float32 alike, most at 1-16 rows and on the 49k-row LM head (docs/performance.md).

Only on the CPU, only for float32 and bfloat16, only when this torch has the oneDNN ops; CUDA and
everything else keep F.linear. The packed copy costs the weights' size again in memory (the plain
weight stays: tensor-parallel loading, the small-row float32 kernel and weight accounting read it).
Set once at load, read-only afterwards: safe from any thread.
"""

from __future__ import annotations

import logging
import os

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


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight.T (+ bias), weight given as `pack(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


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
    log.info("packed %d weight matrices for oneDNN (%s)", count, dtype)
    return count

"""4-bit weights kept 4-bit on the GPU: a checkpoint's 4-bit weights (GPTQ, AWQ, compressed-tensors' W4A16,
AutoRound: those the loader keeps as ggml's Q4_0 / Q4_1 blocks, common/checkpoint_quantization.
kept_in_blocks) and a GGUF's Q4_0 / Q4_1 / Q4_K matrices become int4_linear's layout
(kernels/triton/int4_matmul.py) and a linear layer's `quant` runs that kernel: a quarter of bfloat16's
weight memory and weight reads, where dequantizing at load took the serving dtype's (a 70B GPTQ checkpoint
then needs ~140 GB). The mode is "int4" (quantized.resolve: --quantization auto on CUDA for such a checkpoint
or a GGUF; asked for by name on the CPU, it runs the kernel under the Triton interpreter, as the tests do).

Conversion (once, at load, on the CPU): a block of 32 inputs with d (and m) in float16 is a group of 32,
scales d and offsets -8 d (Q4_0) or m (Q4_1), exact in float16; Q4_K's sub-blocks of 32 are groups of 32 with
float32 scales d * sc and offsets -dmin * m (exact in float32, not in float16); the values' nibbles repacked 8
to an int32 word along the inputs. Parts of one layer (q/k/v, gate/up) stack along the outputs.

What stays float: an embedding table, and a layer with a part that is not 4-bit (a Q4_K_M file's Q6_K V or
down rows) or whose parts' input orders differ: their blocks are dequantized into the float weight (as
--quantization none would load them).
Threads: load time only (finalize); linear() is the forward's, as any layer's.
"""

from __future__ import annotations

from collections import Counter

import torch
from gguf import GGMLQuantizationType

from pagedserve.kernels import reference
from pagedserve.worker.embedding_table import EmbeddingTable
from pagedserve.worker.quantized import QuantizedTensor, in_input_order, shared_input_order

Q4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}


def _words(q: torch.Tensor) -> torch.Tensor:
    """int32 [K / 8, N] of values 0..15 [N, K]: input k of a column at bits 4 * (k % 8) of its word k // 8."""
    rows, cols = q.shape
    words = (q.to(torch.int64).reshape(rows, cols // 8, 8) << (torch.arange(8) * 4)).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the same 32 bits, signed
    return words.t().contiguous()


def from_q4k_blocks(t: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight int32 [K / 8, N], scales float32 [K / 32, N], offsets float32 [K / 32, N]) of a [N, K] Q4_K
    tensor: ggml's super-block of 256 is d and dmin (float16), 12 bytes of eight 6-bit scales and mins, then
    128 bytes, byte j of each 32-byte quarter holding value j of its first sub-block of 32 in its low nibble
    and value j of its second in its high one; sub-block i's weight is d * sc_i * q - dmin * m_i, exact as
    float32 scales d * sc_i and offsets -dmin * m_i (not as float16)."""
    rows, cols = t.shape
    blocks = t.blocks.reshape(rows, cols // 256, 144).to(torch.int64)
    d = t.blocks.reshape(rows, cols // 256, 144)[..., 0:2].contiguous().view(torch.float16).float()  # [N, S, 1]
    dmin = t.blocks.reshape(rows, cols // 256, 144)[..., 2:4].contiguous().view(torch.float16).float()
    packed = blocks[..., 4:16]  # ggml's get_scale_min_k4
    low = torch.cat([packed[..., 0:4] & 63, (packed[..., 8:12] & 0xF) | ((packed[..., 0:4] >> 6) << 4)], -1)
    mins = torch.cat([packed[..., 4:8] & 63, (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)], -1)
    nibbles = blocks[..., 16:].reshape(rows, cols // 256, 4, 32)
    q = torch.stack([nibbles & 0xF, nibbles >> 4], dim=3).reshape(rows, cols)  # [N, S, quarter, 2, 32]
    scales = (d * low.float()).reshape(rows, cols // 32)
    offsets = (-dmin * mins.float()).reshape(rows, cols // 32)
    return _words(q), scales.t().contiguous(), offsets.t().contiguous()


def from_q4_blocks(t: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight int32 [K / 8, N], scales float16 [K / 32, N], offsets float16 [K / 32, N]) of a [N, K] Q4_0
    or Q4_1 tensor: ggml's block is d (float16), for Q4_1 m (float16), then 16 bytes, byte j holding
    value j in its low nibble and value j + 16 in its high one; the weight is d * q - 8 d (Q4_0) or
    d * q + m (Q4_1)."""
    rows, cols = t.shape
    size = _BLOCK_BYTES[t.qtype]
    blocks = t.blocks.reshape(rows, cols // 32, size)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)  # [N, K / 32]
    offset = -8 * d if t.qtype == GGMLQuantizationType.Q4_0 else blocks[..., 2:4].contiguous().view(
        torch.float16).squeeze(-1)
    nibbles = blocks[..., size - 16:].to(torch.int64)
    q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(rows, cols)
    return _words(q), d.t().contiguous(), offset.t().contiguous()


def int4_layout(t: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4_linear's (qweight, scales, offsets) of a Q4_0, Q4_1 or Q4_K tensor."""
    return from_q4k_blocks(t) if t.qtype == GGMLQuantizationType.Q4_K else from_q4_blocks(t)


def dequantize_q4(t: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight of a Q4_0 / Q4_1 / Q4_K tensor in torch (no compiled kernels needed), its inputs in
    order."""
    return in_input_order(reference.int4_weight(*int4_layout(t)).to(dtype), t.input_order)


class Int4Weight:
    """A linear layer's weight in int4_linear's layout on the device: its parts stacked by outputs; their
    shared input_order (GPTQ's act order; None: in order) gathers x's columns before the kernel."""

    __slots__ = ("qweight", "scales", "offsets", "qtypes", "row_counts", "input_order", "_kernel")

    def __init__(self, parts: list[QuantizedTensor], device: torch.device) -> None:
        # imported here, at load (triton's interpreter must be settled first in the tests), not on every call
        from pagedserve.kernels.triton.int4_matmul import int4_linear
        self._kernel = int4_linear
        converted = [int4_layout(p) for p in parts]
        # Q4_K's scales are float32 (float16 cannot hold d * sc exactly): a layer mixing it takes float32 ones
        scale_dtype = torch.float32 if any(c[1].dtype == torch.float32 for c in converted) else torch.float16
        self.qweight = torch.cat([c[0] for c in converted], dim=1).to(device)
        self.scales, self.offsets = (torch.cat([c[i].to(scale_dtype) for c in converted], dim=1).to(device)
                                     for i in (1, 2))
        self.qtypes = [p.qtype for p in parts]
        self.row_counts = [p.shape[0] for p in parts]  # each part's outputs (a LoRA's slices)
        order = parts[0].input_order
        self.input_order = None if order is None else order.to(device)

    @property
    def nbytes(self) -> int:
        """The device memory the weight takes (words, scales and offsets)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.offsets))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        out = self._kernel(x.reshape(-1, x.shape[-1]), self.qweight, self.scales, self.offsets, out_dtype=dtype)
        if bias is not None:
            out += bias
        return out.reshape(*lead, out.shape[-1])

    def describe(self) -> Counter:
        return Counter(q.name for q in self.qtypes)


def finalize(model: torch.nn.Module, device: torch.device) -> Counter:
    """After the load: each linear layer whose parts all arrived as Q4_0 / Q4_1 blocks takes an Int4Weight
    (its float weight dropped) when they share one input order; any other kept blocks are dequantized into the
    float weight. Returns the formats kept."""
    formats: Counter = Counter()
    for module in model.modules():
        parts = getattr(module, "quant_parts", None)
        if not parts:
            continue
        weight = module.weight
        sizes = getattr(module, "output_sizes", [weight.shape[0]])
        offsets = getattr(module, "offsets", [0])
        if not isinstance(module, EmbeddingTable) and len(parts) == len(sizes) and all(
                p.qtype in Q4_TYPES for p in parts.values()) and shared_input_order(parts.values()) is not False:
            module.quant = Int4Weight([parts[i] for i in range(len(sizes))], device)
            module.weight = torch.nn.Parameter(torch.empty(0, weight.shape[1], dtype=weight.dtype, device=device),
                                               requires_grad=False)
            formats += module.quant.describe()
        else:
            for i, part in parts.items():
                weight.data.narrow(0, offsets[i], sizes[i]).copy_(dequantize(part, weight.dtype))
        module.quant_parts = None
    return formats


def dequantize(t: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """Kept blocks as float: Q4_0 / Q4_1 / Q4_K in torch, other formats (a GGUF's Q5_0, Q8_0, Q6_K) with the
    gguf package's numpy dequantization (a GPU machine may have no compiler for the CPU kernels)."""
    return dequantize_q4(t, dtype) if t.qtype in Q4_TYPES else t.dequantize(None, dtype)

"""4-bit weights kept 4-bit on the GPU: a checkpoint's 4-bit weights (GPTQ, AWQ, compressed-tensors' W4A16,
AutoRound: those the loader keeps as ggml's Q4_0 / Q4_1 blocks, common/checkpoint_quantization.
kept_in_blocks) become int4_linear's layout (kernels/triton/int4_matmul.py) and a linear layer's `quant`
runs that kernel: a quarter of bfloat16's weight memory and weight reads, where dequantizing at load
took the serving dtype's (a 70B GPTQ checkpoint then needs ~140 GB). The mode is "int4"
(quantized.resolve: --quantization auto on CUDA for such a checkpoint; asked for by name on the CPU, it
runs the kernel under the Triton interpreter, as the tests do).

Conversion (once, at load, on the CPU): a block of 32 inputs with d (and m) in float16 is a group of 32,
scales d and offsets -8 d (Q4_0) or m (Q4_1), exact in float16; the values' nibbles repacked 8 to an
int32 word along the inputs. Parts of one layer (q/k/v, gate/up) stack along the outputs.

What stays float: an embedding table, and a layer with a part that is not Q4_0 / Q4_1 or not 4-bit at
all: their blocks are dequantized into the float weight (as --quantization none would load them).
Threads: load time only (finalize); linear() is the forward's, as any layer's.
"""

from __future__ import annotations

from collections import Counter

import torch
from gguf import GGMLQuantizationType

from pagedserve.kernels import reference
from pagedserve.worker.embedding_table import EmbeddingTable
from pagedserve.worker.quantized import QuantizedTensor, in_input_order, shared_input_order

Q4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}


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
    q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(rows, cols // 8, 8)  # [N, K / 8, 8]
    words = (q << (torch.arange(8) * 4)).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the same 32 bits, signed
    return words.t().contiguous(), d.t().contiguous(), offset.t().contiguous()


def dequantize_q4(t: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight of a Q4_0 / Q4_1 tensor in torch (no compiled kernels needed), its inputs in order."""
    return in_input_order(reference.int4_weight(*from_q4_blocks(t)).to(dtype), t.input_order)


class Int4Weight:
    """A linear layer's weight in int4_linear's layout on the device: its parts stacked by outputs; their
    shared input_order (GPTQ's act order; None: in order) gathers x's columns before the kernel."""

    __slots__ = ("qweight", "scales", "offsets", "qtypes", "row_counts", "input_order", "_kernel")

    def __init__(self, parts: list[QuantizedTensor], device: torch.device) -> None:
        # imported here, at load (triton's interpreter must be settled first in the tests), not on every call
        from pagedserve.kernels.triton.int4_matmul import int4_linear
        self._kernel = int4_linear
        converted = [from_q4_blocks(p) for p in parts]
        self.qweight, self.scales, self.offsets = (torch.cat([c[i] for c in converted], dim=1).to(device)
                                                   for i in range(3))
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
    """Kept blocks as float: Q4_0 / Q4_1 in torch, other formats through the CPU kernels."""
    if t.qtype in Q4_TYPES:
        return dequantize_q4(t, dtype)
    from pagedserve.kernels import cpu_ops
    return t.dequantize(cpu_ops.load(), dtype)

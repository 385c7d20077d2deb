"""Linear weights kept quantized on the CPU: GGUF blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) as the
file stores them (Gemma 3's Q4_K_M file holds Q5_0 where rows are not multiples of 256), or float
weights rounded to Q8_0 blocks (`--quantization int8`, weight-only int8 with a scale per 32
values), multiplied by kernels/cpu/quant_linear.cpp, which reads the blocks.

--quantization: auto (the default) keeps a GGUF's own blocks and leaves HF folders in float;
none dequantizes everything at load (the float path: correctness tests); on CUDA `auto` takes 4-bit
weights to the int4 kernel (worker/int4_weight.py) and dequantizes the rest at load; int8 rounds every linear
weight (and the LM head) of any checkpoint to Q8_0. Norms, biases and float16/32 GGUF tensors
stay in float. A QuantizedTensor is rows of whole blocks: tensor-parallel ranks take whole rows
(column-parallel) or whole blocks of every row (row-parallel: the split must fall on a block
boundary, else the load fails naming the sizes). Blocks whose columns are the inputs in another order
(GPTQ's act order, its groups gathered into runs: `input_order`) take whole rows only; the layer gathers
its input's columns in that order before the kernel, and every float view puts them back. Set at load,
read-only afterwards.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedserve.worker.embedding_table import is_matmul_weight, lm_head

log = logging.getLogger(__name__)

CHOICES = ("auto", "none", "int8")
# Weights that are not repacked (Q5_0, Q4_K, Q6_K; every format without AVX-512 VNNI): more rows
# than this (prefill chunks, batches of over 8 sequences) run a float matmul on the dequantized
# weight: there the arithmetic, not the weight bytes, bounds a step, and the block kernel's per-block
# scaling costs ~3x oneDNN's bfloat16 at 64 rows (docs/performance.md). float32 activations take
# dequant_lane_linear (16 weight rows dequantized at a time into the lane kernel's layout: the weight
# read once as blocks, ~2x dequantize-then-oneDNN at 51 rows on an AVX2 EPYC); bfloat16 dequantizes
# DEQUANTIZE_CHUNK rows at a time for oneDNN. The repacked kernel needs no such switch.
DEQUANTIZE_ABOVE = 8
DEQUANTIZE_CHUNK = 4096  # weight rows dequantized at a time on that path
# The activation rounded to int8 twice (the rounding error again): one rounding (llama.cpp's q8
# scheme) flipped 3.3% of the default model's teacher-forced top-1 tokens against float32.
PRECISE = True
KERNEL_TYPES = {GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")}
# Formats repacked at load into 16-row tiles for the decode kernel (kernels/cpu/quant_repack.cpp:
# ~2.5x the block-at-a-time kernel at one row); the others stay as stored.
REPACK_TYPES = {GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q8_0")}
REPACK = True
# From this many bfloat16 rows on (prefill chunks), repacked weights too are dequantized
# DEQUANTIZE_CHUNK rows at a time for oneDNN's bfloat16 matmul: the int8 kernel's work grows with the
# rows (it rounds the activation twice: PRECISE), the dequantization does not. The default model's
# 30 layers at 512 rows: 473-604 ms in the repacked kernel, 379-405 ms dequantized; at 256 rows they
# break even (docs/performance.md). float32 rows stay on the kernel (MKL's float32 matmul is no
# faster than it there), and so does every row on a CPU without avx512_bf16 or AMX, where oneDNN's
# bfloat16 matmul is emulated (~61 GFLOP/s on an AVX-512 Xeon without them).
DEQUANTIZE_PACKED_FROM = 384


@dataclass(slots=True)
class QuantizedTensor:
    """A [rows, cols] weight as uint8 blocks [rows, cols / block * bytes_per_block]; input_order (int64
    [cols], None: in order): the blocks' column j is the weight's column input_order[j]."""
    blocks: torch.Tensor
    qtype: GGMLQuantizationType
    cols: int
    input_order: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.cols)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        if dim == 0:
            return QuantizedTensor(self.blocks.narrow(0, start, length), self.qtype, self.cols, self.input_order)
        if (start, length) == (0, self.cols):
            return self
        if self.input_order is not None:
            raise ValueError(f"columns [{start}:{start + length}] of blocks whose inputs are in another order (act "
                             "order) are no run of them: such a split is dequantized at load")
        block, size = GGML_QUANT_SIZES[self.qtype]
        if start % block or length % block:
            raise ValueError(f"a tensor-parallel split at columns [{start}:{start + length}] does not fall on "
                             f"{self.qtype.name} blocks of {block}; use --quantization none for this split")
        return QuantizedTensor(self.blocks.narrow(1, start // block * size, length // block * size).contiguous(),
                               self.qtype, length)

    def permute_rows(self, order: torch.Tensor) -> QuantizedTensor:
        return QuantizedTensor(self.blocks[order].contiguous(), self.qtype, self.cols, self.input_order)

    def padded_rows(self, rows: int) -> QuantizedTensor:
        """Zero rows added below (a zero block is zero in every format: its scales are 0)."""
        extra = rows - self.blocks.shape[0]
        if extra <= 0:
            return self
        pad = torch.zeros(extra, self.blocks.shape[1], dtype=torch.uint8)
        return QuantizedTensor(torch.cat([self.blocks, pad]), self.qtype, self.cols, self.input_order)

    def dequantize(self, ops, dtype: torch.dtype) -> torch.Tensor:
        """The weight in float through the CPU kernels, or (ops None: none built, as on a GPU machine without
        a compiler) the gguf package's numpy dequantization."""
        if ops is not None:
            rows = ops.dequantize_rows(self.blocks, int(self.qtype), self.cols)
        else:
            from gguf.quants import dequantize as gguf_dequantize
            rows = torch.from_numpy(gguf_dequantize(self.blocks.numpy(), self.qtype).reshape(-1, self.cols).copy())
        return in_input_order(rows.to(dtype), self.input_order)


def in_input_order(weight: torch.Tensor, input_order: torch.Tensor | None) -> torch.Tensor:
    """A float view of blocks ([rows, cols], their columns in input_order) with its columns back in order."""
    if input_order is None:
        return weight
    out = torch.empty_like(weight)
    out[:, input_order] = weight
    return out


class QuantizedWeight:
    """A layer's weight as one or more QuantizedTensors stacked by rows (q/k/v or gate/up parts
    may come in different formats: a Q4_K_M file stores some V rows as Q6_K).

    When every part is Q4_0, Q4_1 or Q8_0 and the CPU has AVX-512 VNNI, the parts are repacked at
    construction into 16-row interleaved tiles (kernels/cpu/quant_repack.cpp: the same bytes, so
    no extra memory; the original blocks are dropped) and every matmul runs the repacked kernel, but
    bfloat16 prefill chunks of DEQUANTIZE_PACKED_FROM rows or more, which dequantize the tiles for
    oneDNN; row lookups (the embedding, the LM head's re-scoring) unpack the rows they need."""

    __slots__ = ("ops", "qtypes", "cols", "row_counts", "input_order", "_blocks", "_qtypes", "_packed")

    def __init__(self, parts: list[QuantizedTensor], ops) -> None:
        """The parts share one input_order (quantized.finalize sees to it)."""
        self.ops = ops
        self.input_order = parts[0].input_order
        self.qtypes = [p.qtype for p in parts]
        self.cols = parts[0].cols
        self.row_counts = [p.blocks.shape[0] for p in parts]
        self._qtypes = [int(p.qtype) for p in parts]
        self._packed: list[torch.Tensor] | None = None
        self._blocks: list[torch.Tensor] | None = [p.blocks for p in parts]
        if REPACK and all(p.qtype in REPACK_TYPES for p in parts) and ops.repacked_kernel_available():
            self._packed = [_repack(ops, p) for p in parts]
            self._blocks = None

    @property
    def repacked(self) -> bool:
        return self._packed is not None

    @property
    def nbytes(self) -> int:
        """The weight's bytes as stored in the file (what a step reads; the tiles' padding aside)."""
        return sum(n * self.cols // GGML_QUANT_SIZES[q][0] * GGML_QUANT_SIZES[q][1]
                   for n, q in zip(self.row_counts, self.qtypes))

    def part_blocks(self, part: int, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The original blocks of part `part`'s rows `ids` (default: all), uint8 [rows, bytes]."""
        if self._packed is None:
            blocks = self._blocks[part]
            return blocks if ids is None else blocks[ids]
        if ids is None:
            ids = torch.arange(self.row_counts[part])
        return self.ops.unpack_rows(self._packed[part], self._qtypes[part], self.cols, ids)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [rows, cols] @ weight.T (+ bias), in `dtype` (default x's). Repacked weights: the repacked
        kernel, below DEQUANTIZE_PACKED_FROM bfloat16 rows (see there). Others: up to DEQUANTIZE_ABOVE
        rows the block kernel reads the blocks (a decode step: memory-bound); more rows (prefill, big
        batches: compute-bound) run a float matmul on the dequantized weight (see DEQUANTIZE_ABOVE). Blocks
        in another input order take x's columns in that order."""
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        if self._packed is None and x.shape[0] > DEQUANTIZE_ABOVE and x.dtype in (torch.float32, torch.bfloat16):
            if x.dtype == torch.float32 and _lane_kernel(self.ops):
                out = self.ops.dequant_lane_linear(x if x.stride(-1) == 1 else x.contiguous(), self._blocks,
                                                   self._qtypes)
            else:
                out = self._dequantized_linear(x)
            if bias is not None:
                out += bias
            return out if dtype is None else out.to(dtype)
        if self._packed is not None and x.shape[0] >= DEQUANTIZE_PACKED_FROM and x.dtype == torch.bfloat16 \
                and _native_bfloat16():
            out = self._dequantized_linear(x)
            if bias is not None:
                out += bias
            return out if dtype is None else out.to(dtype)
        if self._packed is not None:  # it beat the dequantized matmul at 8..128 rows
            # bfloat16 out of the kernel itself when that is what the caller keeps (no bias to add
            # in float first): a conversion op per call is ~5% of a decode step's matmul time
            bf16 = (dtype or x.dtype) == torch.bfloat16 and bias is None
            out = self.ops.repacked_linear(x, self._packed, self._qtypes, self.row_counts, PRECISE, bf16)
            if bf16:
                return out
        else:
            out = self.ops.quant_linear(x, self._blocks, self._qtypes, PRECISE)
        if bias is not None:
            out += bias
        return out.to(dtype or x.dtype)

    def _dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T through the weight dequantized DEQUANTIZE_CHUNK rows at a time: a whole LM head
        (49k x 576) dequantized at once is a fresh 56 MB buffer each call, and its page faults cost
        more than the matmul; chunks of a few MB are recycled by the allocator."""
        bf16 = x.dtype == torch.bfloat16
        outs = []
        for part, (rows, qtype) in enumerate(zip(self.row_counts, self._qtypes)):
            for start in range(0, rows, DEQUANTIZE_CHUNK):
                if self._packed is None:
                    blocks = self._blocks[part][start:start + DEQUANTIZE_CHUNK]
                else:  # the tiles' rows back as blocks first
                    blocks = self.part_blocks(part, torch.arange(start, min(rows, start + DEQUANTIZE_CHUNK)))
                w = self.ops.dequantize_rows(blocks, qtype, self.cols, bf16)
                outs.append(F.linear(x, w))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        bf16 = dtype == torch.bfloat16
        parts = [self.ops.dequantize_rows(self.part_blocks(i), q, self.cols, bf16) for i, q in enumerate(self._qtypes)]
        return in_input_order(parts[0] if len(parts) == 1 else torch.cat(parts), self.input_order)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight rows `ids` in float (an embedding lookup; one part only)."""
        (qtype,) = self._qtypes
        blocks = self.part_blocks(0, ids.reshape(-1))
        rows = in_input_order(self.ops.dequantize_rows(blocks, qtype, self.cols, dtype == torch.bfloat16),
                              self.input_order)
        return rows.to(dtype).reshape(*ids.shape, self.cols)

    def describe(self) -> Counter:
        return Counter(q.name for q in self.qtypes)


@cache
def _native_bfloat16() -> bool:
    """Whether the CPU multiplies bfloat16 itself (avx512_bf16 or AMX): oneDNN's bfloat16 matmul is
    fast only then. The same test as the dtype choice's (platform.pick_dtype)."""
    from pagedserve.kernels.cpu_ops import cpu_has_fast_bf16
    return cpu_has_fast_bf16()


@cache
def _lane_kernel(ops) -> bool:
    """Whether the CPU kernels have the float32 lane kernel (AVX-512, or AVX2 with FMA)."""
    return ops.lane_linear_available(False)


def _repack(ops, part: QuantizedTensor) -> torch.Tensor:
    """The part's tiles. When its rows fill whole tiles (every SmolLM2/Llama shape) they are made in
    the blocks' own storage, a group at a time: a fresh copy per weight (freed originals of a few MB
    each stay in the allocator's heap) cost ~30 MiB of RSS. Only a tensor that owns its storage is
    overwritten: a layer's blocks belong to that layer alone."""
    blocks = part.blocks.contiguous()
    owns_storage = blocks.storage_offset() == 0 and blocks.untyped_storage().nbytes() == blocks.numel()
    if not owns_storage or blocks.shape[0] % 16:  # a view into a shared tensor, or a padded last tile
        return ops.repack_rows(blocks, int(part.qtype))
    ops.repack_rows_(blocks, int(part.qtype))
    return blocks.view(blocks.shape[0] // 16, -1)


def quantize_q8_0(weight: torch.Tensor, input_order: torch.Tensor | None = None) -> QuantizedTensor:
    """Float weight [rows, cols] -> Q8_0 blocks: per 32 values a float16 scale amax/127 and int8s; with
    input_order, its columns in that order."""
    if input_order is not None:
        weight = weight[:, input_order]
    rows, cols = weight.shape
    if cols % 32:
        raise ValueError(f"--quantization int8 needs rows of a multiple of 32 values, got {cols}")
    w = weight.detach().float().reshape(rows, cols // 32, 32)
    d = (w.abs().amax(-1, keepdim=True) / 127).half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros((), dtype=torch.float32))
    q = torch.round(w * inv).clamp_(-127, 127).to(torch.int8)
    blocks = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1)  # [rows, blocks, 2 + 32]
    return QuantizedTensor(blocks.reshape(rows, -1).contiguous(), GGMLQuantizationType.Q8_0, cols, input_order)


def resolve(requested: str, device: torch.device, is_gguf: bool, int4_blocks: bool = False) -> str:
    """What the load does: "gguf" (keep the file's blocks), "int8", "int4" (a checkpoint's 4-bit blocks in
    the GPU's int4 kernel: worker/int4_weight.py) or "none". is_gguf: the file's blocks or a checkpoint's
    4-bit ones can be kept; int4_blocks: the int4 kernel can take some (a checkpoint's 4-bit ones, a GGUF's
    Q4 ones; the rest dequantized). "int4" by name (the tests, on the CPU: the kernel under the Triton
    interpreter) is not a --quantization choice."""
    if requested == "int4":
        return "int4" if int4_blocks else "none"
    if requested not in CHOICES:
        raise ValueError(f"--quantization must be one of {', '.join(CHOICES)}, got {requested!r}")
    if requested == "none" or (requested == "auto" and not is_gguf):
        return "none"
    if device.type != "cpu" and requested == "auto" and int4_blocks:
        return "int4"
    if device.type != "cpu":
        log.warning("--quantization %s: no quantized kernel on %s yet; weights are dequantized at load",
                    requested, device.type)
        return "none"
    from pagedserve.kernels import cpu_ops
    if cpu_ops.load() is None:
        log.warning("--quantization %s: the CPU kernels are not built here; weights are dequantized at load",
                    requested)
        return "none"
    return "gguf" if requested == "auto" else "int8"


def finalize(model: torch.nn.Module, mode: str) -> Counter:
    """After the load: layers that received quantized parts (or, for int8, every linear weight and
    the LM head) switch to the quantized kernel and drop their float weight. Returns the formats."""
    from pagedserve.kernels import cpu_ops

    ops = cpu_ops.load()
    head = lm_head(model)
    formats: Counter = Counter()
    for module in model.modules():
        parts = getattr(module, "quant_parts", None)
        if parts is None:
            continue
        weight = module.weight
        int8 = mode == "int8" and weight.dim() == 2 and weight.numel() and weight.dtype.is_floating_point \
            and is_matmul_weight(module, head)
        if not parts and not int8:
            continue
        offsets = getattr(module, "offsets", [0])
        sizes = getattr(module, "output_sizes", [weight.shape[0]])
        order = shared_input_order(parts.values())
        if order is False:  # parts in different input orders (act order): the layer stays float
            for i, part in parts.items():
                weight.data.narrow(0, offsets[i], sizes[i]).copy_(part.dequantize(ops, weight.dtype))
            module.quant_parts = None
            continue
        for i in range(len(sizes)):  # int8: every part; else a float part beside quantized ones (float16)
            if i not in parts:
                parts[i] = quantize_q8_0(weight.narrow(0, offsets[i], sizes[i]), order)
        module.quant = QuantizedWeight([parts[i] for i in range(len(sizes))], ops)
        module.weight = torch.nn.Parameter(torch.empty(0, weight.shape[1], dtype=weight.dtype), requires_grad=False)
        module.quant_parts = None
        formats += module.quant.describe()
    return formats


def shared_input_order(parts) -> torch.Tensor | None | bool:
    """The input order every part has (None: in order), or False where they differ (GPTQ's act order
    quantizes each matrix in its own order; q/k/v and gate/up, which see the same inputs, share theirs)."""
    orders = [p.input_order for p in parts]
    first = orders[0] if orders else None
    same = all((o is None and first is None) or (o is not None and first is not None and torch.equal(o, first))
               for o in orders)
    return first if same else False

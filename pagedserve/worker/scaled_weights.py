"""Checkpoint weights stored in 8 bits or fewer with scales (FP8, compressed-tensors' 8-bit float or int and
packed int, AutoAWQ's and GPTQ's packed int), dequantized to the serving dtype as they are read:
weight = stored.float() * scale, the scale broadcast per tensor, per output channel or per block
(common/checkpoint_quantization.ScaledWeights). A tensor-parallel rank reads only its rows (or, of a packed
matrix, whole rows for its columns) and the scales that cover them.

The scale tensors of a weight `X.weight` are `X.weight_scale` or `X.weight_scale_inv` (DeepSeek's name for
the same multiplier). compressed-tensors' pack-quantized format stores `X.weight_packed` (int32 words, value
i of a row at bits i*b.. of the row's words, little-endian, plus 2^(b-1)) and `X.weight_shape`. Activation
scales (`X.input_scale`, `X.input_scale_ub`) and an FP8 KV cache's (`k_scale`, `v_scale`) are not used
here: the layers compute in the serving dtype. `unused` names them so the loader skips them.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from pagedserve.common.checkpoint_quantization import ScaledWeights
from pagedserve.worker.quantized import QuantizedTensor

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
UNUSED_SUFFIXES = SCALE_SUFFIXES + (".input_scale", ".input_scale_ub", ".k_scale", ".v_scale",
                                    ".weight_zero_point", ".input_zero_point", ".weight_shape")
PACKED = ".weight_packed"
AWQ_PACKED = ".qweight"  # AutoAWQ's and GPTQ's name
AWQ_TENSORS = (".qzeros", ".scales", ".g_idx")  # read with their qweight
# AutoAWQ interleaves a word's 8 output columns: column 8j + k is at bits 4 * AWQ_REVERSE_ORDER[k] of word j
# (as compressed-tensors' AutoAWQConverter reads it).
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unused(name: str) -> bool:
    """A scale tensor: read with its weight (or not at all), never loaded as a parameter."""
    return name.endswith(UNUSED_SUFFIXES)


def scale_name(weight_name: str, names) -> str | None:
    """The scale of weight_name among the checkpoint's names, if it is stored scaled."""
    if not weight_name.endswith(".weight"):
        return None
    return next((n for n in (weight_name + s[len(".weight"):] for s in SCALE_SUFFIXES) if n in names), None)


def awq_entry(name: str, where: dict, scheme: ScaledWeights, keep: bool = False):
    """(X.weight, its shape [out, in], its AwqSource) for AutoAWQ's X.qweight."""
    module = name.removesuffix(AWQ_PACKED)
    needed = [module + ".scales"] + ([module + ".qzeros"] if scheme.zero_points else [])
    missing = [n for n in needed if n not in where]
    if missing:
        raise ValueError(f"{name} has no {' or '.join(missing)} beside it")
    inputs, words = where[name].get_slice(name).get_shape()
    zeros = (where[needed[1]], needed[1]) if scheme.zero_points else None
    shape = (words * 8, inputs)
    return module + ".weight", shape, AwqSource((where[name], name), (where[needed[0]], needed[0]), zeros, scheme,
                                                shape, keep)


class AwqSource:
    """AutoAWQ's GEMM layout: dequantized whole (its words pack 8 output columns) and then cut; or, keep
    (the CPU kernels), as Q4_0 / Q4_1 blocks."""

    __slots__ = ("weight", "scale", "zero", "scheme", "shape", "keep")

    def __init__(self, weight, scale, zero, scheme: ScaledWeights, shape: tuple[int, int], keep: bool = False) -> None:
        self.weight, self.scale, self.zero, self.scheme, self.shape = weight, scale, zero, scheme, shape
        self.keep = keep and shape[1] % 32 == 0

    def read(self, dim: int, start: int, length: int, dtype: torch.dtype) -> torch.Tensor | QuantizedTensor:
        q = awq_unpack(self.weight[0].get_tensor(self.weight[1])).T  # [out, in], 0..15
        scale = self.scale[0].get_tensor(self.scale[1]).T  # [out, groups]
        zero = awq_unpack(self.zero[0].get_tensor(self.zero[1])).T if self.zero is not None else torch.full_like(
            scale, 8, dtype=torch.int8)
        if self.keep:
            return q4_blocks(q, scale, zero if self.zero is not None else None).narrow(dim, start, length)
        window = [(0, self.shape[0]), (0, self.shape[1])]
        window[dim] = (start, start + length)
        (r0, r1), (c0, c1) = window
        return dequantize(q[r0:r1, c0:c1], scale, self.scheme.block, self.shape, window, zero).to(dtype)


def gptq_entry(name: str, where: dict, scheme: ScaledWeights, keep: bool = False):
    """(X.weight, its shape [out, in], its GptqSource) for GPTQ's X.qweight."""
    module = name.removesuffix(AWQ_PACKED)
    missing = [module + n for n in (".qzeros", ".scales") if module + n not in where]
    if missing:
        raise ValueError(f"{name} has no {' or '.join(missing)} beside it")
    words, outputs = where[name].get_slice(name).get_shape()
    bits = scheme.bits_of(module)
    shape = (outputs, words * 32 // bits)
    g_idx = (where[module + ".g_idx"], module + ".g_idx") if module + ".g_idx" in where else None
    return module + ".weight", shape, GptqSource(
        (where[name], name), (where[module + ".scales"], module + ".scales"),
        (where[module + ".qzeros"], module + ".qzeros"), g_idx, scheme, shape, bits,
        keep and bits == 4 and shape[1] % 32 == 0)


class GptqSource:
    """GPTQ's layout: X.qweight [in * b / 32, out] int32, each column its inputs' values as one little-endian
    bit string; X.qzeros [groups, out * b / 32], each row its outputs' zero points so (less
    scheme.zero_offset); X.scales [groups, out]; X.g_idx [in], each input's group (in act order a
    permutation of the runs; absent or in order: input // group). A rank's rows are its columns of the
    words; its columns need all of them. keep (the CPU kernels, the int4 kernel): Q4_0 / Q4_1 blocks; in act
    order, of the inputs gathered by group (QuantizedTensor.input_order), for whole rows (a rank's columns,
    no run of groups, are dequantized). b is the module's bits (GPTQModel's dynamic overrides may give it its
    own)."""

    __slots__ = ("weight", "scale", "zero", "g_idx", "scheme", "shape", "bits", "keep")

    def __init__(self, weight, scale, zero, g_idx, scheme: ScaledWeights, shape: tuple[int, int], bits: int,
                 keep: bool = False) -> None:
        self.weight, self.scale, self.zero, self.g_idx = weight, scale, zero, g_idx
        self.scheme, self.shape, self.bits, self.keep = scheme, shape, bits, keep

    def read(self, dim: int, start: int, length: int, dtype: torch.dtype) -> torch.Tensor | QuantizedTensor:
        rows, cols = self.shape
        r0, r1 = (start, start + length) if dim == 0 and not self.keep else (0, rows)
        bits, half = self.bits, 1 << (self.bits - 1)
        q = unpack(self.weight[0].get_slice(self.weight[1])[:, r0:r1].T, bits, cols).to(torch.int16) + half
        zero = (unpack(self.zero[0].get_tensor(self.zero[1]), bits, rows)[:, r0:r1].to(torch.int16) + half
                + self.scheme.zero_offset).T  # [rows, groups]
        scale = self.scale[0].get_tensor(self.scale[1])[:, r0:r1].T.to(torch.float32)
        group = self._groups(cols, scale.shape[1])
        order = None if group is None else runs_order(group, scale.shape[1])
        # act order: blocks of the inputs gathered by group (whole rows only: a rank's columns are no run)
        if self.keep and (group is None or (order is not None and (dim == 0 or length == cols))):
            symmetric = bool((zero == half).all())
            blocks = q4_blocks(q if order is None else q[:, order], scale, None if symmetric else zero)
            blocks.input_order = order
            return blocks.narrow(dim, start, length)
        if group is None:
            group = torch.arange(cols) // (cols // scale.shape[1])
        weight = (q - zero[:, group]).to(torch.float32) * scale[:, group]
        return (weight if dim == 0 else weight[:, start:start + length]).to(dtype)

    def _groups(self, cols: int, groups: int) -> torch.Tensor | None:
        """Each input's group from X.g_idx, or None when the groups are runs of cols / groups inputs."""
        if cols % groups:
            raise ValueError(f"{self.weight[1]}: {groups} groups of scales for {cols} inputs")
        in_order = torch.arange(cols) // (cols // groups)
        if self.g_idx is None:
            return None
        group = self.g_idx[0].get_tensor(self.g_idx[1]).to(torch.int64)
        if group.shape != (cols,) or int(group.min()) < 0 or int(group.max()) >= groups:
            raise ValueError(f"{self.g_idx[1]} is not a group (0..{groups - 1}) for each of {cols} inputs")
        return None if torch.equal(group, in_order) else group


def runs_order(group: torch.Tensor, groups: int) -> torch.Tensor | None:
    """The inputs gathered by group (stable), when every group has as many inputs (GPTQ's act order: its
    groups in runs of cols / groups); None when they do not."""
    if not bool((torch.bincount(group, minlength=groups) == group.numel() // groups).all()):
        return None
    return torch.argsort(group, stable=True)


def q4_blocks(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> QuantizedTensor:
    """[rows, cols] 4-bit values 0..15 with a scale (and a zero point 0..15) per row and group of inputs
    ([rows, groups], [rows, 1] or one) as ggml's blocks of 32: Q4_0 (d, then value j | value j + 16 << 4
    a byte; the weight is d * (q - 8)) without zero points, else Q4_1 (d, m = -d * zero, the same bytes;
    d * q + m)."""
    rows, cols = q.shape
    blocks = cols // 32
    scale = scale.to(torch.float32).reshape(-1, scale.shape[-1] if scale.dim() == 2 else 1).expand(rows, -1)
    per_block = blocks // scale.shape[1]
    if per_block * scale.shape[1] != blocks:
        raise ValueError(f"groups of {cols // scale.shape[1]} inputs are not whole blocks of 32")
    d = scale.repeat_interleave(per_block, 1).reshape(rows, blocks, 1)
    values = q.to(torch.uint8).reshape(rows, blocks, 32)
    parts = [d.to(torch.float16).view(torch.uint8)]
    if zero is not None:
        m = -d * zero.to(torch.float32).reshape(rows, -1).repeat_interleave(per_block, 1).reshape(rows, blocks, 1)
        parts.append(m.to(torch.float16).view(torch.uint8))
    parts.append(values[..., :16] | (values[..., 16:] << 4))
    qtype = GGMLQuantizationType.Q4_0 if zero is None else GGMLQuantizationType.Q4_1
    return QuantizedTensor(torch.cat(parts, dim=-1).reshape(rows, -1).contiguous(), qtype, cols)


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """[rows, n] int32 words of AutoAWQ -> [rows, 8n] int8 values 0..15, in column order."""
    shifts = 4 * torch.tensor(AWQ_REVERSE_ORDER)
    return ((words.to(torch.int64)[:, :, None] >> shifts) & 0xF).reshape(words.shape[0], -1).to(torch.int8)


def packed_entry(name: str, where: dict, scheme: ScaledWeights, keep: bool = False):
    """(X.weight, its shape, its ScaledSource) for a packed matrix X.weight_packed (with X.weight_zero_point
    when the scheme is asymmetric)."""
    weight = name.removesuffix(PACKED) + ".weight"
    scale, shape, zero = scale_name(weight, where), weight + "_shape", weight + "_zero_point"
    if scale is None or shape not in where:
        raise ValueError(f"{name} is packed with no {weight}_scale or {weight}_shape beside it")
    if scheme.zero_points and zero not in where:
        raise ValueError(f"{name} is packed asymmetric with no {zero} beside it")
    rows, cols = (int(v) for v in where[shape].get_tensor(shape).tolist())
    return weight, (rows, cols), ScaledSource((where[name], name), (where[scale], scale), scheme, (rows, cols),
                                              (where[zero], zero) if scheme.zero_points else None,
                                              keep and scheme.packed_bits == 4 and cols % 32 == 0)


class ScaledSource:
    """A LazyWeight's source: the 8-bit tensor and its scale, in the checkpoint (read on demand)."""

    __slots__ = ("weight", "scale", "scheme", "shape", "zero", "keep")

    def __init__(self, weight, scale, scheme: ScaledWeights, shape: tuple[int, ...], zero=None,
                 keep: bool = False) -> None:
        """weight, scale, zero (packed zero points, or None): (safe_open handle, name) pairs; keep: a packed
        4-bit matrix read as Q4_0 / Q4_1 blocks (the CPU kernels), not dequantized."""
        self.weight, self.scale, self.scheme, self.shape, self.zero = weight, scale, scheme, tuple(shape), zero
        self.keep = keep

    def read(self, dim: int, start: int, length: int, dtype: torch.dtype) -> torch.Tensor | QuantizedTensor:
        """Rows (dim 0) or columns (dim 1) [start, start + length), dequantized to dtype (or kept)."""
        handle, name = self.weight
        if self.keep:
            q = unpack(handle.get_tensor(name), 4, self.shape[1]).to(torch.int16) + 8
            zero = None
            if self.zero is not None:
                zero = unpack(self.zero[0].get_tensor(self.zero[1]).T, 4, self.shape[0]).T.to(torch.int16) + 8
            return q4_blocks(q, self.scale[0].get_tensor(self.scale[1]), zero).narrow(dim, start, length)
        if self.scheme.packed_bits:  # whole rows: a column's values share words with its neighbours'
            rows = (start, start + length) if dim == 0 else (0, self.shape[0])
            stored = unpack(handle.get_slice(name)[rows[0]:rows[1]], self.scheme.packed_bits, self.shape[1])
            stored = stored if dim == 0 else stored[:, start:start + length]
        else:
            index = (slice(None),) * dim + (slice(start, start + length),)
            stored = handle.get_slice(name)[index]
        handle, name = self.scale
        scale = handle.get_tensor(name)
        zero = None
        if self.zero is not None:  # packed along the rows: [ceil(rows * b / 32), groups] words
            handle, name = self.zero
            zero = unpack(handle.get_tensor(name).T, self.scheme.packed_bits, self.shape[0]).T
        window = [(0, self.shape[0]), (0, self.shape[1] if len(self.shape) > 1 else 1)]
        window[dim] = (start, start + length)
        return dequantize(stored, scale, self.scheme.block, self.shape, window, zero).to(dtype)


def unpack(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """[rows, n] int32 words -> [rows, cols] int8 values: value i of a row is bits i*b..i*b+b-1 of the row's
    words read as one little-endian bit string, stored plus 2^(b-1)."""
    words = words.to(torch.int64) & 0xFFFFFFFF
    start = torch.arange(cols) * bits
    word, shift = start // 32, start % 32
    value = words[:, word] >> shift
    spill = shift + bits > 32  # the value's high bits in the next word
    if bool(spill.any()):
        value[:, spill] |= words[:, word[spill] + 1] << (32 - shift[spill])
    return ((value & ((1 << bits) - 1)) - (1 << (bits - 1))).to(torch.int8)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, shape: tuple[int, ...],
               window: list[tuple[int, int]], zero: torch.Tensor | None = None) -> torch.Tensor:
    """stored (the rows and columns `window` of a matrix of `shape`) less its zero point (laid out as the
    scale, or None), times its scale, in float32."""
    values = stored.to(torch.float32)
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return values * scale.reshape(())
    if len(shape) != 2:
        raise ValueError(f"a scale of shape {tuple(scale.shape)} for a weight of shape {shape}: only matrices "
                         "have per-channel or block scales")
    rows, cols = shape
    blocks = None if block is None else (-(-rows // block[0]), -(-cols // block[1]))
    if blocks is None or tuple(scale.shape) != blocks:
        if scale.numel() != rows or (scale.dim() == 2 and scale.shape[1] != 1):
            expected = f"1, {rows} (a channel each)" + (f" or {blocks} (blocks of {block[0]}x{block[1]})" if blocks
                                                       else "")
            raise ValueError(f"a scale of shape {tuple(scale.shape)} for a weight of shape {shape}: expected "
                             f"{expected}")
        block, scale = (1, cols), scale.reshape(rows, 1)
    (r0, r1), (c0, c1) = window
    row_blocks = torch.arange(r0, r1) // block[0]
    col_blocks = torch.arange(c0, c1) // block[1]
    if zero is not None:
        values = values - zero.reshape(scale.shape).to(torch.float32)[row_blocks][:, col_blocks]
    return values * scale[row_blocks][:, col_blocks]

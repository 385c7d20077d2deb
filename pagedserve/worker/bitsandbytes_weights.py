"""bitsandbytes checkpoints (transformers' serialization of Linear4bit and Linear8bitLt, as the hub's
"-bnb-4bit" models ship), dequantized to the serving dtype as they are read. The layers then compute in that
dtype on the dequantized weights: not bitsandbytes' matmuls (LLM.int8's outlier columns, its 4-bit
kernels), and with the serving dtype's memory.

4-bit (NF4 or FP4), for a weight X.weight of shape [out, in] (n values):
- X.weight: the packed values, [n / 2, 1] bytes (of any storage dtype), the matrix in row order, two values a
  byte, the first in the high nibble; each value a code, 0..15;
- X.weight.quant_map [16]: each code's value; X.weight.absmax [n / blocksize]: each block's scale, or (double
  quantization) uint8 codes of X.weight.nested_quant_map [256], times X.weight.nested_absmax (one a
  nested_blocksize of them), plus nested_offset;
- X.weight.quant_state.bitsandbytes__nf4 (or __fp4): JSON bytes (blocksize, shape, nested_blocksize,
  nested_offset).
8-bit (LLM.int8): X.weight int8 [out, in] and X.SCB [out]: weight = value * SCB / 127.

Torch only; no bitsandbytes import (the tests read these checkpoints with bitsandbytes as the reference).
"""

from __future__ import annotations

import json

import torch

FOUR_BIT_STATES = (".weight.quant_state.bitsandbytes__nf4", ".weight.quant_state.bitsandbytes__fp4")
SUFFIXES = (".weight.absmax", ".weight.quant_map", ".weight.nested_absmax", ".weight.nested_quant_map",
            ".SCB", ".weight_format") + FOUR_BIT_STATES


def bnb_entry(name: str, where: dict):
    """(X.weight, its shape, its source) when X.weight is stored by bitsandbytes (a quant state or an SCB
    beside it), else None: a weight left in float (llm_int8_skip_modules) is read as it is."""
    if not name.endswith(".weight"):
        return None
    module = name.removesuffix(".weight")
    state = next((module + s for s in FOUR_BIT_STATES if module + s in where), None)
    if state is not None:
        source = FourBitSource(name, where, state)
        return name, source.shape, source
    if module + ".SCB" in where:
        shape = tuple(where[name].get_slice(name).get_shape())
        return name, shape, Int8RowSource((where[name], name), (where[module + ".SCB"], module + ".SCB"), shape)
    return None


class FourBitSource:
    """A 4-bit weight: dequantized whole (its blocks run along the flattened matrix), then cut."""

    __slots__ = ("tensors", "state", "shape")

    def __init__(self, name: str, where: dict, state_name: str) -> None:
        self.state = json.loads(bytes(where[state_name].get_tensor(state_name).to(torch.uint8).tolist()))
        self.shape = tuple(int(v) for v in self.state["shape"])
        parts = ("", ".absmax", ".quant_map") + ((".nested_absmax", ".nested_quant_map")
                                                  if "nested_blocksize" in self.state else ())
        missing = [name + p for p in parts if name + p not in where]
        if missing:
            raise ValueError(f"{name} is stored in 4 bits by bitsandbytes with no {' or '.join(missing)} beside it")
        self.tensors = {p: (where[name + p], name + p) for p in parts}

    def _get(self, part: str) -> torch.Tensor:
        handle, name = self.tensors[part]
        return handle.get_tensor(name)

    def read(self, dim: int, start: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        n = self.shape[0] * self.shape[1]
        packed = self._get("").contiguous().view(torch.uint8).reshape(-1)
        codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n].to(torch.int64)
        values = self._get(".quant_map").to(torch.float32)[codes]
        blocksize = int(self.state["blocksize"])
        scale = self._absmax(blocksize, n)
        weight = (values * scale.repeat_interleave(blocksize)[:n]).reshape(self.shape)
        return weight.narrow(dim, start, length).to(dtype)

    def _absmax(self, blocksize: int, n: int) -> torch.Tensor:
        absmax = self._get(".absmax")
        blocks = -(-n // blocksize)
        if "nested_blocksize" in self.state:  # double quantization: the scales are codes themselves
            nested = int(self.state["nested_blocksize"])
            codes = absmax.to(torch.int64)
            scale = self._get(".nested_absmax").to(torch.float32).repeat_interleave(nested)[:codes.numel()]
            absmax = self._get(".nested_quant_map").to(torch.float32)[codes] * scale + float(
                self.state.get("nested_offset", 0.0))
        if absmax.numel() != blocks:
            raise ValueError(f"{self.tensors['.absmax'][1]}: {absmax.numel()} scales for {blocks} blocks of "
                             f"{blocksize} values")
        return absmax.to(torch.float32)


class Int8RowSource:
    """LLM.int8's weight: int8 values and a scale a row (SCB / 127); a rank reads only its rows or columns."""

    __slots__ = ("weight", "scale", "shape")

    def __init__(self, weight, scale, shape: tuple[int, ...]) -> None:
        self.weight, self.scale, self.shape = weight, scale, shape

    def read(self, dim: int, start: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        handle, name = self.weight
        index = (slice(None),) * dim + (slice(start, start + length),)
        values = handle.get_slice(name)[index].to(torch.float32)
        scale = self.scale[0].get_tensor(self.scale[1]).to(torch.float32).reshape(-1, 1) / 127.0
        return (values * (scale[start:start + length] if dim == 0 else scale)).to(dtype)

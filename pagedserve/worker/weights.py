"""Read a model folder's weights as HF-named tensors: *.safetensors (sharded too) or model.gguf. A checkpoint
of 8-bit or packed weights with scales (FP8, compressed-tensors, AWQ, GPTQ, bitsandbytes: config.json's
quantization_config) is dequantized as it is read (scaled_weights.py); its scale tensors are not yielded."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from pagedserve.common.checkpoint_quantization import scaled_weights
from pagedserve.worker import bitsandbytes_weights
from pagedserve.worker.quantized import QuantizedTensor
from pagedserve.worker.scaled_weights import (AWQ_PACKED, AWQ_TENSORS, PACKED, AwqSource, GptqSource, ScaledSource,
                                               awq_entry, gptq_entry, packed_entry, scale_name, unused)

SOURCES = (ScaledSource, AwqSource, GptqSource, bitsandbytes_weights.FourBitSource, bitsandbytes_weights.Int8RowSource)
# a packed layout -> (its packed tensor's suffix, the entry that reads it with its scales)
_PACKED_ENTRIES = {"": (PACKED, packed_entry), "awq": (AWQ_PACKED, awq_entry), "gptq": (AWQ_PACKED, gptq_entry)}


def weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    ggufs = sorted(folder.glob("*.gguf"))
    if ggufs:
        return ggufs[:1]
    raise FileNotFoundError(f"no weights in {folder}: expected *.safetensors files or a .gguf file")


class LazyWeight:
    """A checkpoint tensor not read yet: a tensor-parallel rank reads only its rows or columns
    (safetensors slices are read from the memory-mapped file; GGUF tensors are dequantized whole)."""

    __slots__ = ("_source", "dtype", "shape")

    def __init__(self, source, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._source, self.shape, self.dtype = source, tuple(shape), dtype

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor | QuantizedTensor:
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(f"slice [{start}:{start + length}] of dim {dim} is outside a tensor of shape {self.shape}")
        if isinstance(self._source, QuantizedTensor):
            return self._source.narrow(dim, start, length)
        if isinstance(self._source, torch.Tensor):
            return self._source.narrow(dim, start, length).to(self.dtype)
        if isinstance(self._source, SOURCES):
            return self._source.read(dim, start, length, self.dtype)
        handle, name = self._source
        index = (slice(None),) * dim + (slice(start, start + length),)
        return handle.get_slice(name)[index].to(self.dtype)

    def full(self) -> torch.Tensor | QuantizedTensor:
        if isinstance(self._source, QuantizedTensor):
            return self._source
        if isinstance(self._source, torch.Tensor):
            return self._source.to(self.dtype)
        if isinstance(self._source, SOURCES):
            return self._source.read(0, 0, self.shape[0], self.dtype)
        handle, name = self._source
        return handle.get_tensor(name).to(self.dtype)


def iter_lazy_weights(folder: str | Path, dtype: torch.dtype, progress: bool = True,
                      keep_quantized: bool = False) -> Iterator[tuple[str, LazyWeight]]:
    """keep_quantized: a GGUF's weights in the formats the CPU kernels read stay as their blocks, and so do
    a checkpoint's 4-bit weights that are such blocks (kept_in_blocks)."""
    folder = Path(folder)
    files = weight_files(folder)
    if files[0].suffix == ".gguf":
        from pagedserve.worker.gguf_weights import iter_gguf_weights
        for name, tensor in tqdm(iter_gguf_weights(files[0], dtype, keep_quantized), desc="loading weights",
                                 unit="tensor",
                                 disable=not progress, leave=False):
            yield name, LazyWeight(tensor, tensor.shape, dtype)
        return
    config = folder / "config.json"
    scheme = scaled_weights(json.loads(config.read_text())) if config.is_file() else None
    if scheme is not None:
        yield from _scaled_checkpoint(files, dtype, scheme, progress, keep_quantized)
        return
    for path in tqdm(files, desc="loading weights", unit="file", disable=not progress or len(files) < 2):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, LazyWeight((f, name), f.get_slice(name).get_shape(), dtype)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"cannot read weight file {path}: {exc}") from exc


EIGHT_BIT = ("F8_E4M3", "F8_E5M2", "I8")


def _scaled_checkpoint(files: list[Path], dtype: torch.dtype, scheme, progress: bool, keep: bool):
    """Every file open at once: a weight's scale may be stored in another shard. keep: 4-bit matrices stay
    as Q4_0 / Q4_1 blocks (common/checkpoint_quantization.kept_in_blocks)."""
    with contextlib.ExitStack() as stack:
        where = {}
        for path in files:
            try:
                handle = stack.enter_context(safe_open(path, framework="pt"))
            except (SafetensorError, OSError) as exc:
                raise ValueError(f"cannot read weight file {path}: {exc}") from exc
            where.update((name, handle) for name in handle.keys())
        for name in tqdm(list(where), desc="loading weights", unit="tensor", disable=not progress, leave=False):
            if unused(name) or (scheme.layout == "bitsandbytes" and name.endswith(bitsandbytes_weights.SUFFIXES)):
                continue
            if scheme.layout in ("awq", "gptq") and name.endswith(AWQ_TENSORS):
                continue  # read with their qweight
            found = _packed(name, where, scheme, keep)
            if found is not None:
                weight, shape, source = found
                yield weight, LazyWeight(source, shape, dtype)
                continue
            handle = where[name]
            stored = handle.get_slice(name)
            shape = stored.get_shape()
            scale = scale_name(name, where)
            if scale is None and stored.get_dtype() in EIGHT_BIT:
                raise ValueError(f"{name} is stored in 8 bits ({stored.get_dtype()}) with no scale beside it "
                                 "(.weight_scale or .weight_scale_inv)")
            source = (handle, name) if scale is None else ScaledSource((handle, name), (where[scale], scale), scheme,
                                                                       shape)
            yield name, LazyWeight(source, shape, dtype)


def _packed(name: str, where: dict, scheme, keep: bool):
    """(weight name, shape, source) when `name` is a packed tensor of the scheme's layout, else None."""
    if scheme.layout == "bitsandbytes":
        return bitsandbytes_weights.bnb_entry(name, where)
    suffix, entry = _PACKED_ENTRIES[scheme.layout]
    return entry(name, where, scheme, keep) if scheme.packed_bits and name.endswith(suffix) else None


def iter_weights(folder: str | Path, dtype: torch.dtype, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    for name, lazy in iter_lazy_weights(folder, dtype, progress):
        yield name, lazy.full()

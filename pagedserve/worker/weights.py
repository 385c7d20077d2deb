"""Read a model folder's weights as HF-named tensors: *.safetensors (sharded too) or model.gguf."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from pagedserve.worker.quantized import QuantizedTensor


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
        handle, name = self._source
        index = (slice(None),) * dim + (slice(start, start + length),)
        return handle.get_slice(name)[index].to(self.dtype)

    def full(self) -> torch.Tensor | QuantizedTensor:
        if isinstance(self._source, QuantizedTensor):
            return self._source
        if isinstance(self._source, torch.Tensor):
            return self._source.to(self.dtype)
        handle, name = self._source
        return handle.get_tensor(name).to(self.dtype)


def iter_lazy_weights(folder: str | Path, dtype: torch.dtype, progress: bool = True,
                      keep_quantized: bool = False) -> Iterator[tuple[str, LazyWeight]]:
    """keep_quantized: a GGUF's weights in the formats the CPU kernels read stay as their blocks."""
    folder = Path(folder)
    files = weight_files(folder)
    if files[0].suffix == ".gguf":
        from pagedserve.worker.gguf_weights import iter_gguf_weights
        for name, tensor in tqdm(iter_gguf_weights(files[0], dtype, keep_quantized), desc="loading weights",
                                 unit="tensor",
                                 disable=not progress, leave=False):
            yield name, LazyWeight(tensor, tensor.shape, dtype)
        return
    for path in tqdm(files, desc="loading weights", unit="file", disable=not progress or len(files) < 2):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, LazyWeight((f, name), f.get_slice(name).get_shape(), dtype)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"cannot read weight file {path}: {exc}") from exc


def iter_weights(folder: str | Path, dtype: torch.dtype, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    for name, lazy in iter_lazy_weights(folder, dtype, progress):
        yield name, lazy.full()

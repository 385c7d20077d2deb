"""Read a model folder's weights as HF-named tensors: *.safetensors (sharded too) or model.gguf."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm


def weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    ggufs = sorted(folder.glob("*.gguf"))
    if ggufs:
        return ggufs[:1]
    raise FileNotFoundError(f"no weights in {folder}: expected *.safetensors files or a .gguf file")


def iter_weights(folder: str | Path, dtype: torch.dtype, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    folder = Path(folder)
    files = weight_files(folder)
    if files[0].suffix == ".gguf":
        from services.worker.gguf_loader import iter_gguf_weights
        yield from tqdm(iter_gguf_weights(files[0], dtype), desc="loading weights", unit="tensor",
                        disable=not progress, leave=False)
        return
    for path in tqdm(files, desc="loading weights", unit="file", disable=not progress or len(files) < 2):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).to(dtype)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"cannot read weight file {path}: {exc}") from exc

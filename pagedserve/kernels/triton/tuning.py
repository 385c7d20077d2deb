"""Launch configurations of the Triton kernels per GPU model: tile sizes, warps and pipeline stages, as
vLLM keeps tuned fused-MoE configs per device. Measured on the GPU itself by
`python -m pagedserve.kernels.tune`, which writes a table this module reads.

A table is JSON: {"device": "NVIDIA_H200", "kernels": {kernel: {shape key: {param: value}}}}. The
tables shipped for GPU models are configs/<device>.json beside this file; a file named by the
environment variable PAGEDSERVE_KERNEL_CONFIGS (a tuner's output, not yet committed) is laid over
them, whatever device it names. A shape key is what the tile choice depends on besides the batch
(dtype, head dims, page size, expert shapes); a kernel whose best tiles depend on the batch too
(fused MoE on the token count) keys several sizes "<key> M=<n>", and a call takes the nearest one at
or above its own size, else the largest (vLLM's rule for its MoE tables).

Every wrapper resolves its launch parameters the same way: an argument its caller gave > the table's
entry > its default. Off CUDA (the interpreter in tests) the tables are never read: defaults only.

Threads: any; each file is read and each device's table merged once per process (cached): a kernel call
(every layer, every eager step) costs a few dict reads here."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
ENV = "PAGEDSERVE_KERNEL_CONFIGS"


def device_name(device: torch.device) -> str:
    """The GPU model as a file name: torch's device name with spaces as underscores (NVIDIA_H200)."""
    return _device_name(torch.cuda.current_device() if device.index is None else device.index)


@cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index).replace(" ", "_")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@cache
def _read(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        return {}
    table = json.loads(p.read_text())
    kernels = table.get("kernels")
    if not isinstance(kernels, dict):
        raise ValueError(f"{path}: a kernel config table needs a 'kernels' object")
    return kernels


@cache
def merged_table(name: str, override: str | None) -> dict:
    """The shipped table of device `name` with the override file's entries laid over it (once a process:
    every kernel call of every layer looks here; the result is not to be changed)."""
    merged: dict = {}
    for path in (str(CONFIG_DIR / f"{name}.json"), override):
        for kernel, entries in (_read(path) if path else {}).items():
            merged.setdefault(kernel, {}).update(entries)
    return merged


def pick(entries: dict, key: str, size: int | None) -> dict | None:
    """The entry for `key`: exact when `size` is None; else among the entries "<key> M=<n>" the nearest
    n >= size, or the largest n when size exceeds them all."""
    if size is None:
        return entries.get(key)
    sized = sorted((int(k.rsplit("M=", 1)[1]), v) for k, v in entries.items() if k.startswith(f"{key} M="))
    if not sized:
        return entries.get(key)
    return next((v for n, v in sized if n >= size), sized[-1][1])


def choose(table: dict, kernel: str, key: str, default: dict, given: dict, size: int | None = None) -> dict:
    """Launch parameters: `given` (the caller's, None values left out) over the table's entry over `default`;
    an entry's parameters the kernel does not take are ignored."""
    params = dict(default)
    entry = pick(table.get(kernel, {}), key, size) or {}
    params.update({k: v for k, v in entry.items() if k in default})
    params.update({k: v for k, v in given.items() if v is not None})
    return params


def resolve(kernel: str, key: str, device: torch.device, default: dict, given: dict, size: int | None = None) -> dict:
    """choose() with the table of `device`'s GPU model; off CUDA with none."""
    table = merged_table(device_name(device), os.environ.get(ENV)) if device.type == "cuda" else {}
    return choose(table, kernel, key, default, given, size)


def write_table(path: str | Path, device: str, kernels: dict) -> None:
    Path(path).write_text(json.dumps({"device": device, "kernels": kernels}, indent=1, sort_keys=True) + "\n")

"""Rows of a step's device tensors picked without a host sync: values and row indices go up through pinned
memory without blocking (indexing a device tensor with a Python list would copy it up and wait). Used by the
sampler, its truncation and the step overlap. Threads: the worker's torch thread only."""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of host values on `device`: built on the host, on CUDA copied up from pinned memory
    without blocking the host (torch's caching host allocator keeps the pinned block until the copy
    has run), on the CPU as it is."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def row_index(rows: list[int], total: int, device: torch.device) -> torch.Tensor | None:
    """rows as an index tensor on `device` (indexing a device tensor with a Python list would copy the
    list up and wait for the device), or None when rows are every row in order (no gather needed)."""
    if len(rows) == total:  # rows are increasing and distinct: all of them
        return None
    return to_device(rows, torch.long, device)


def take_rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


def put_rows(x: torch.Tensor, index: torch.Tensor | None, values: torch.Tensor) -> None:
    if index is None:
        x.copy_(values)
    else:
        x.index_copy_(0, index, values)

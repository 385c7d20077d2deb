"""The tensor-parallel ranks' process group and the collectives the sharded layers call.

TPGroup is this rank's place in the group (rank, world size, the torch.distributed group); the
current one is a process-wide global that init_tensor_parallel sets, close_tensor_parallel resets
to a single rank, and using_group swaps while an engine's model runs (one process may hold a
single-rank engine beside a tensor-parallel one). all_reduce, broadcast_from_rank0 and
all_gather_last_dim act on the current group and are no-ops on one rank. Which backend the ranks
talk over (NCCL between GPUs, gloo between CPU processes) and which device a rank takes are
decided here too (the arithmetic: device_memory.rank_device). The layers that shard weights across
the group live in parallel.py, which imports this module (never the reverse).

Invariants: every rank calls each collective in the same order; callers read the current group
through tp_group() at each use, never by importing the global itself (init, close and using_group
rebind it). Threads: the torch thread, the one that builds and steps the model; the global is not
thread-local, so one engine steps at a time in a process.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedserve.worker.device_memory import rank_device, visible_devices


@dataclass(slots=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: object = None  # the torch.distributed group; None on a single rank


_tp = TPGroup()


def tp_group() -> TPGroup:
    return _tp


@contextlib.contextmanager
def using_group(group: TPGroup):
    """Make `group` the current one while a model built under it runs: one process may hold a
    single-rank engine beside a tensor-parallel one (bench tp), and the layers' collectives must
    follow the engine that is stepping."""
    global _tp
    previous, _tp = _tp, group
    try:
        yield group
    finally:
        _tp = previous


def dist_backend(device: torch.device) -> str:
    """The collectives' backend between ranks: NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_torch_device(device: torch.device, local: int, device_count: int | None = None,
                      env: Mapping[str, str] | None = None) -> torch.device:
    """The device a rank with this local rank (its index among the ranks on this host) takes:
    `cuda:<local>` for a CUDA device (device_memory.rank_device: the index counts the devices
    CUDA_VISIBLE_DEVICES shows), the CPU as it is. device_count and env default to torch's count
    and this process's environment."""
    if device.type != "cuda":
        return device
    env = os.environ if env is None else env
    count = torch.cuda.device_count() if device_count is None else device_count
    return torch.device(rank_device("cuda", local, count, visible_devices(env)))


def init_tensor_parallel(rank: int, world_size: int, init_method: str | None, device: torch.device,
                         timeout_s: float = 600.0) -> TPGroup:
    """Join the ranks' process group (gloo on CPU, NCCL on CUDA). A no-op for one rank. A CUDA
    device must name its index (rank_torch_device): it becomes this process's current device,
    which NCCL's communicator is bound to."""
    global _tp
    if device.type == "cuda":
        if device.index is None:
            raise ValueError(f"rank {rank}: a CUDA device without an index ({device}); take rank_torch_device's")
        torch.cuda.set_device(device)
    if world_size == 1:
        _tp = TPGroup()
        return _tp
    if not 0 <= rank < world_size:
        raise ValueError(f"--rank {rank} is outside the tensor-parallel group of size {world_size}")
    if init_method is None:
        raise ValueError("tensor parallelism needs a rendezvous address (--dist-init-addr host:port)")
    if not dist.is_initialized():
        dist.init_process_group(dist_backend(device), init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _tp = TPGroup(rank, world_size, dist.group.WORLD)
    return _tp


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp.world_size > 1:
        dist.all_reduce(x, group=_tp.group)
    return x


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    if _tp.world_size > 1:
        dist.broadcast(x, src=0, group=_tp.group)
    return x


def close_tensor_parallel() -> None:
    """Leave the process group, so that a later engine in this process can form a new one."""
    global _tp
    if _tp.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _tp = TPGroup()


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _tp.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_tp.group)
    return torch.cat(parts, dim=-1)

"""Tensor parallelism inside one engine (`pagedserve generate`, the benchmarks): rank 0 runs in
the engine's process, ranks 1..N-1 are spawned processes that receive every call by a
torch.distributed broadcast from rank 0. (The services send each rank its step over gRPC.)

Every rank is on this host: rank r takes cuda:<r> on CUDA (process_group.rank_torch_device, whatever
LOCAL_RANK this process was given) and the ranks talk over NCCL; on the CPU over gloo. The calls
themselves go over gloo on CUDA too (a group of their own): over NCCL a follower would read each
message through its GPU's stream, behind the step it still runs, and could not begin the next step
while the device finishes the one before (async scheduling: worker/step_overlap.py)."""

from __future__ import annotations

import logging
import multiprocessing
import os

import torch
import torch.distributed as dist

from pagedserve.worker.process_group import close_tensor_parallel, dist_backend, init_tensor_parallel, rank_torch_device

log = logging.getLogger(__name__)


class LocalRanks:
    """Ranks 1..N-1 of an in-process engine. `call(method, *args)` runs the same ModelRunner
    method on every follower; rank 0 then runs it itself, so collectives inside line up."""

    def __init__(self, world_size: int, device: torch.device, runner_kwargs: dict, timeout_s: float = 600.0) -> None:
        """device: the device kind (rank r takes rank_torch_device(device, r)); runner_kwargs: the
        ModelRunner's, its device replaced by each rank's own."""
        from pagedserve.common.grpc_util import free_port

        # Every rank's device first: one that has no GPU fails here, not as a follower rank 0 waits for.
        devices = [rank_torch_device(device, rank) for rank in range(world_size)]
        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = multiprocessing.get_context("spawn")  # fork would copy torch's thread pools and locks
        threads = max(1, (os.cpu_count() or 1) // world_size)
        self.processes = [context.Process(target=_follower_main, daemon=True, name=f"pagedserve-rank{rank}",
                                          args=(rank, world_size, init_method, devices[rank], runner_kwargs,
                                                threads, timeout_s))
                          for rank in range(1, world_size)]
        for process in self.processes:
            process.start()
        self.previous_threads = torch.get_num_threads()
        torch.set_num_threads(threads)  # the ranks share this machine's cores
        init_tensor_parallel(0, world_size, init_method, devices[0], timeout_s)
        self.group = message_group(devices[0])
        self.closed = False

    def call(self, method: str, *args) -> None:
        dist.broadcast_object_list([(method, args)], src=0, group=self.group)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.call("stop")
        except RuntimeError as exc:  # a follower already died: the group is broken
            log.warning("tensor-parallel ranks did not take the stop message: %s", exc)
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        close_tensor_parallel()
        torch.set_num_threads(self.previous_threads)


def _follower_main(rank: int, world_size: int, init_method: str, device: torch.device, runner_kwargs: dict,
                   threads: int, timeout_s: float) -> None:
    from pagedserve.worker.model_runner import ModelRunner

    torch.set_num_threads(threads)
    init_tensor_parallel(rank, world_size, init_method, device, timeout_s)
    group = message_group(device)
    runner = ModelRunner(**{**runner_kwargs, "device": device})
    try:
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0, group=group)
            method, args = message[0]
            if method == "stop":
                break
            getattr(runner, method)(*args)
    finally:
        close_tensor_parallel()


def message_group(device: torch.device):
    """The group rank 0's calls go over: the ranks' own where it is gloo (the CPU), else a gloo group
    beside NCCL's (made on every rank in the same order: collectively)."""
    return None if dist_backend(device) == "gloo" else dist.new_group(backend="gloo")

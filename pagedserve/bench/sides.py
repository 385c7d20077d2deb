"""The two sides of a bench that sets the in-process engine against the services (`bench services`,
`bench embeddings`; planner accuracy starts its services here too): the services started as
processes for a bench's engine flags (start_services) and their scheduler's stats, whether the
bench's device is a GPU, and on a GPU one side resident at a time (Sides, pair_order: ABBA order,
so each switch serves two runs; free_device_memory gives a released engine's memory back).

Invariants: exclusive (a GPU), Sides keeps at most one side resident: the engine is released
(closed, collected, torch's cache emptied) before the services start, the services stopped (their
processes exited) before the engine is built again; Sides holds the only reference to the engine
it built. Threads: the caller's.
"""

from __future__ import annotations

import logging

from pagedserve.common.settings import setting

log = logging.getLogger(__name__)


def on_gpu(device: str) -> bool:
    """Whether the bench's device is a GPU (auto: CUDA when torch sees one)."""
    if device == "cuda":
        return True
    if device != "auto":
        return False
    import torch
    return torch.cuda.is_available()


def start_services(args, model_path, **extra):
    """The stack for args' engine settings; extra: other StackConfig fields (bench embeddings: runner)."""
    from pagedserve.common.grpc_util import free_port
    from pagedserve.launcher.processes import StackConfig, start_stack

    return start_stack(StackConfig(
        model=str(model_path), port=free_port(), grpc_port=free_port(), redis_url=args.redis_url,
        device=args.device, dtype=args.dtype, quantization=args.quantization,
        # plan-accuracy starts its services here too, without this bench's own flag
        omp_wait_policy=getattr(args, "omp_wait_policy", setting("worker", "omp_wait_policy").default),
        cpu_kernel_threads=getattr(args, "cpu_kernel_threads", setting("worker", "cpu_kernel_threads").default),
        no_async_scheduling=getattr(args, "no_async_scheduling", False),
        worker_transport=getattr(args, "worker_transport", setting("scheduler", "worker_transport").default),
        service_transport=getattr(args, "service_transport", setting("gateway", "service_transport").default),
        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=getattr(args, "gpu_memory_utilization",
                                       setting("engine", "gpu_memory_utilization").default),
        swap_space=getattr(args, "swap_space", setting("engine", "swap_space").default),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold, max_model_len=args.max_model_len,
        preemption_mode=args.preemption_mode, scheduling_policy=args.scheduling_policy,
        no_prefix_caching=args.no_prefix_caching, no_chunked_prefill=args.no_chunked_prefill, log_dir=None, **extra))


# ---- one side at a time on a GPU --------------------------------------------------------------------
def free_device_memory() -> int | None:
    """After the last reference to an engine is dropped: collect it (its tensors may sit in
    reference cycles) and on CUDA return torch's cached blocks to the driver, so that a worker
    process measuring the GPU next finds them free. Returns the bytes torch still reserves on the
    GPU (None without CUDA)."""
    import gc
    import sys
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


class Sides:
    """The two sides of the bench, each built when first asked for. exclusive (a GPU: the engine
    and the services' worker would each take --gpu-memory-utilization of it) keeps at most one
    resident: the engine is released before the services start, the services stopped before the
    engine is built again. Otherwise both stay up and the runs alternate as they are.
    build_engine() and start_stack() make a side ready (warm-ups included). Sides holds the only
    reference to the engine it built: a caller keeps none past its run."""

    def __init__(self, build_engine, start_stack, exclusive: bool) -> None:
        self.build_engine, self.start_stack, self.exclusive = build_engine, start_stack, exclusive
        self._engine = None
        self._stack = None

    def engine(self):
        if self._engine is None:
            if self.exclusive:
                self.stop_stack()
            self._engine = self.build_engine()
        return self._engine

    def stack(self):
        if self._stack is None:
            if self.exclusive:
                self.release_engine()
            self._stack = self.start_stack()
        return self._stack

    def release_engine(self) -> None:
        if self._engine is None:
            return
        self._engine.close()  # its tensor-parallel ranks, if any
        self._engine = None  # the last reference (no local keeps it through the collection)
        still = free_device_memory()
        if still is not None:
            log.info("released the in-process engine: torch still reserves %d bytes on the GPU", still)

    def stop_stack(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.stop()  # returns once its processes have exited: their GPU memory is the driver's again

    def close(self) -> None:
        self.stop_stack()
        self.release_engine()


def pair_order(repeat: int, exclusive: bool) -> tuple[str, str]:
    """Which side runs first in a pair: in process first, but where only one side may be resident,
    every other pair the other way round (ABBA), so each switch serves two runs."""
    if exclusive and repeat % 2:
        return ("services", "in_process")
    return ("in_process", "services")


def scheduler_stats(stack):
    from pagedserve.common.grpc_util import internal_channel
    from pagedserve.v1 import scheduler_pb2, scheduler_pb2_grpc
    with internal_channel(stack.addresses["scheduler"]) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.StatsRequest(), timeout=30)

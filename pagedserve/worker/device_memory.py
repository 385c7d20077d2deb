"""Device arithmetic, numbers in and numbers out: which device a worker rank takes, and how many
bytes of KV cache a worker may allocate. No torch here (the platform measures, these decide), so
the rules are tested on any machine.

A rank's device: rank r of a tensor-parallel worker group takes `cuda:<local rank>`, its rank on
this host (LOCAL_RANK when a launcher sets it, as torchrun does, else its rank: the ranks of one
group run on one host). torch numbers the devices CUDA_VISIBLE_DEVICES shows from 0, so the local
rank indexes that list.

The KV budget on a GPU (vLLM's gpu_memory_utilization): this worker may use that share of the
device's total memory; its weights, the activation peak of the largest step and the memory its CUDA
graphs will hold (graph_reserve: the largest captured step's activations, estimated from the peak) come
out of it, and the rest is the KV pool. The pool must also fit in what is free now, beside the peak, since
other processes (or another worker) may hold part of the device. A budget that holds no block, or
that what is free cannot hold, is a KVBudgetError naming every number it saw.

Threads: none; pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

LOCAL_RANK_ENV = "LOCAL_RANK"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


class KVBudgetError(ValueError):
    """The KV pool this worker may have holds no block, or does not fit in what is free."""


# ---- a rank's device -----------------------------------------------------------------------------
def local_rank(rank: int, env: Mapping[str, str]) -> int:
    """This rank's index among the ranks on its host: LOCAL_RANK if set, else the rank itself."""
    text = env.get(LOCAL_RANK_ENV, "").strip()
    if not text:
        return rank
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{LOCAL_RANK_ENV}={text!r} is not a number") from None
    if value < 0:
        raise ValueError(f"{LOCAL_RANK_ENV}={value} is negative")
    return value


def visible_devices(env: Mapping[str, str]) -> list[str] | None:
    """The devices CUDA_VISIBLE_DEVICES names, in order (ids or UUIDs); None when it is unset
    (every device is visible)."""
    text = env.get(VISIBLE_ENV)
    if text is None:
        return None
    return [part.strip() for part in text.split(",") if part.strip()]


def rank_device(device_type: str, local: int, device_count: int, visible: list[str] | None = None) -> str:
    """The device a rank takes: "cpu" on the CPU, else "cuda:<local rank>". device_count is how
    many devices torch sees (it counts only the visible ones); visible is CUDA_VISIBLE_DEVICES as
    visible_devices reads it, for the error and the log."""
    if device_type == "cpu":
        return "cpu"
    if device_type != "cuda":
        raise ValueError(f"no rank device rule for device type {device_type!r}")
    if local < 0:
        raise ValueError(f"local rank {local} is negative")
    if local >= device_count:
        shown = "every device" if visible is None else f"{VISIBLE_ENV}={','.join(visible)!r}"
        raise ValueError(f"local rank {local} needs a GPU at index {local}, but torch sees {device_count} "
                         f"GPU(s) ({shown}): run at most {device_count} ranks on this host, or show each rank "
                         f"its GPU ({VISIBLE_ENV}) and tell it its index among them ({LOCAL_RANK_ENV})")
    return f"cuda:{local}"


def physical_device(local: int, visible: list[str] | None) -> str:
    """The device's name as nvidia-smi lists it: the visible list's entry, or the index itself."""
    if visible is None or local >= len(visible):
        return str(local)
    return visible[local]


# ---- the KV budget -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MemoryReading:
    """One device's memory as a worker measured it after loading its weights and running its
    largest step (the step's memory released again). Bytes."""
    total: int  # the device's memory
    free: int  # free on the device now (every process's use taken out)
    weights: int  # this worker's weights (and the tensors that stay beside them)
    peak: int  # the largest step's activation peak above the weights
    own: int  # what this process's allocator holds now (its weights, its cached blocks)

    @property
    def held_by_others(self) -> int:
        """In use on the device but not by this process's tensors: other processes, and the CUDA
        contexts (this one's included)."""
        return max(0, self.total - self.free - self.own)


def gib(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB"


def describe(reading: MemoryReading, utilization: float, block_bytes: int, graphs: int = 0) -> str:
    """Every number a budget was computed from, for an error or the log."""
    r = reading
    held = f", CUDA graphs ~{gib(graphs)}" if graphs else ""
    return (f"total {gib(r.total)}, free {gib(r.free)}, held by others {gib(r.held_by_others)}, this worker's "
            f"weights {gib(r.weights)}, activation peak {gib(r.peak)}{held}, --gpu-memory-utilization {utilization}, "
            f"block {block_bytes} bytes")


def graph_reserve(peak: int, profiled_tokens: int, graph_tokens: int) -> int:
    """The memory the CUDA graphs' one pool will hold: the activations of the largest step a graph captures
    (graph_tokens tokens; 0: no graphs), estimated from the profiled peak (a step of profiled_tokens) as
    linear in tokens. The graphs are captured after the KV pool is allocated, so this comes out of the
    budget beforehand; the eager peak stays reserved beside it (steps no graph holds still run eagerly)."""
    if graph_tokens < 0 or profiled_tokens < 0 or peak < 0:
        raise ValueError(f"graph_reserve of a negative size: peak {peak}, profiled {profiled_tokens} tokens, "
                         f"graphs {graph_tokens} tokens")
    if not graph_tokens or not profiled_tokens:
        return 0
    return -(-peak * graph_tokens // profiled_tokens)


def kv_budget(reading: MemoryReading, utilization: float, block_bytes: int, graphs: int = 0) -> int:
    """Bytes of KV cache this worker may allocate: utilization x total, less its weights, its activation
    peak and its CUDA graphs' pool (graphs, graph_reserve's estimate); at least one block, and no more than
    what is free beside the peak and the graphs."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    if block_bytes < 1:
        raise ValueError(f"a KV block of {block_bytes} bytes")
    r = reading
    budget = int(r.total * utilization) - r.weights - r.peak - graphs
    if budget < block_bytes:
        graph_remedy = ", or capture fewer graphs (--compilation-config, --enforce-eager)" if graphs else ""
        raise KVBudgetError(
            f"the KV cache budget of {budget} bytes ({gib(budget)}) holds no block: --gpu-memory-utilization "
            f"{utilization} of the GPU less this worker's weights and activation peak"
            f"{' and its CUDA graphs' if graphs else ''} ({describe(r, utilization, block_bytes, graphs)}); raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens, or give --kv-cache-memory{graph_remedy}")
    room = r.free - r.peak - graphs  # the pool, the largest step and the graphs must fit together in what is free
    if budget > room:
        fits = math.floor(1000 * (r.free + r.weights) / r.total) / 1000  # budget <= room, rounded down
        remedy = "stop them" if room < block_bytes else \
            f"stop them, or lower --gpu-memory-utilization to at most {fits}"
        beside = "the activation peak and the CUDA graphs" if graphs else "the activation peak"
        raise KVBudgetError(
            f"the KV cache budget of {budget} bytes ({gib(budget)}) does not fit in what is free on the GPU: "
            f"{max(0, room)} bytes beside {beside} ({describe(r, utilization, block_bytes, graphs)}); other "
            f"processes hold {gib(r.held_by_others)}: {remedy}")
    return budget


def num_blocks(budget: int, block_bytes: int) -> int:
    """Whole blocks in a budget (an explicit --kv-cache-memory, or kv_budget's)."""
    if budget < block_bytes:
        raise KVBudgetError(f"the KV cache budget of {budget} bytes holds no block ({block_bytes} bytes each); "
                            f"raise --kv-cache-memory")
    return budget // block_bytes

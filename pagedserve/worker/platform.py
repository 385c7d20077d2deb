"""The platform seam (vLLM's `platforms/` idea, our own code): every device-specific decision of
a worker in one place, a CPU and a CUDA implementation, chosen once from the device.

A Platform owns
  - the device and dtype choice (pick_device, pick_dtype: the CLI's --device / --dtype),
  - the attention, MLA and MoE backends a model built on it uses,
  - the distributed backend and each rank's device (process_group.dist_backend / rank_torch_device),
  - the memory reading and KV budget (measure_memory, kv_budget; device_memory's arithmetic),
  - the ops bundle the models call (pagedserve.worker.ops): models never learn the device.

Models ask `current_platform()` (the platform of torch's default device, which the model runner
sets while it builds the model) for their backends and ops at construction.

Platforms are stateless apart from their ops bundle, built once (the CPU's loads the compiled
kernels on first use) and cached per device type: safe from any thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from functools import cache

import torch

from pagedserve.kernels.cpu_ops import cpu_has_fast_bf16
from pagedserve.worker import process_group
from pagedserve.worker.attention import AttentionBackend, TritonAttentionBackend
from pagedserve.worker.device_memory import MemoryReading, kv_budget
from pagedserve.worker.mla_attention import MLAAttentionBackend, TorchMLABackend, TritonMLABackend
from pagedserve.worker.moe import GroupedTorchMoE, MoEBackend, TritonMoE
from pagedserve.worker.ops import CpuKernelOps, CudaOps, NativeOps
from pagedserve.worker.torch_attention import CpuKernelAttentionBackend, TorchAttentionBackend

log = logging.getLogger("pagedserve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Platform:
    """What differs between devices. Subclasses: CpuPlatform, CudaPlatform."""

    device_type = ""
    measures_memory = False  # whether the KV pool is sized from a memory reading (else a fixed size)
    # Whether the device runs a step's work after the host has launched it, so the engine gains by
    # beginning the next step before taking this one's tokens (async scheduling: worker/step_overlap.py).
    runs_behind_host = False

    @property
    def ops(self) -> NativeOps:
        raise NotImplementedError

    def default_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Warn about a dtype this device serves badly (nothing by default)."""

    def attention_backend(self) -> AttentionBackend:
        raise NotImplementedError

    def mla_backend(self) -> MLAAttentionBackend:
        raise NotImplementedError

    def moe_backend(self) -> MoEBackend:
        raise NotImplementedError

    def dist_backend(self) -> str:
        return process_group.dist_backend(torch.device(self.device_type))

    def rank_device(self, local_rank: int, device_count: int | None = None,
                    env: Mapping[str, str] | None = None) -> torch.device:
        return process_group.rank_torch_device(torch.device(self.device_type), local_rank, device_count, env)

    def measure_memory(self, runner, max_num_batched_tokens: int) -> MemoryReading | None:
        """The memory reading the KV budget is computed from; None where the pool has a fixed size."""
        return None

    def kv_budget(self, reading: MemoryReading, utilization: float, block_bytes: int, graphs: int = 0) -> int:
        return kv_budget(reading, utilization, block_bytes, graphs)


class CpuPlatform(Platform):
    device_type = "cpu"

    @property
    def ops(self) -> NativeOps:
        return _cpu_ops()

    def kernels(self):
        """The compiled CPU kernels module, or None (no compiler here, or PAGEDSERVE_NO_CPU_KERNELS)."""
        from pagedserve.kernels import cpu_ops
        return cpu_ops.load()

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype == torch.bfloat16 and not cpu_has_fast_bf16():
            # Without avx512_bf16 or AMX nothing computes in bfloat16: torch's bfloat16 matmuls ran at
            # 0.3-2.4 GFLOP/s against 100-130 in float32 on a 2-core Zen 3 EPYC (AVX2 only), and
            # oneDNN's at a quarter of float32's on an AVX-512 Xeon without avx512_bf16. So the linear
            # layers multiply in float32: AVX-512 widens the bfloat16 weights in registers, AVX2 keeps
            # float32 copies of them (cpu_linear.pack).
            log.warning("--dtype bfloat16 on a CPU without avx512_bf16 or AMX: there is no bfloat16 arithmetic "
                        "here, the matmuls widen the weights to float32 (without AVX-512 into float32 copies of "
                        "them, which take 2x the memory), so bfloat16 is no faster than float32 at large batches "
                        "(--dtype auto picks float32)")

    def attention_backend(self) -> AttentionBackend:
        kernels = self.kernels()
        return TorchAttentionBackend() if kernels is None else CpuKernelAttentionBackend(kernels)

    def mla_backend(self) -> MLAAttentionBackend:
        return TorchMLABackend()

    def moe_backend(self) -> MoEBackend:
        return GroupedTorchMoE()


class CudaPlatform(Platform):
    device_type = "cuda"
    measures_memory = True
    runs_behind_host = True

    @property
    def ops(self) -> NativeOps:
        return _cuda_ops()

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def attention_backend(self) -> AttentionBackend:
        if os.environ.get("PAGEDSERVE_ATTENTION") == "torch":  # the reference path, to compare against
            return TorchAttentionBackend()
        return TritonAttentionBackend()

    def mla_backend(self) -> MLAAttentionBackend:
        return TritonMLABackend()

    def moe_backend(self) -> MoEBackend:
        return TritonMoE()

    def measure_memory(self, runner, max_num_batched_tokens: int) -> MemoryReading:
        return measure_cuda_memory(runner, max_num_batched_tokens)


@cache
def _cpu_ops() -> NativeOps:
    kernels = CpuPlatform().kernels()
    return NativeOps() if kernels is None else CpuKernelOps(kernels)


@cache
def _cuda_ops() -> NativeOps:
    return CudaOps()


_PLATFORMS = {"cpu": CpuPlatform(), "cuda": CudaPlatform()}


def platform_for(device: torch.device | str) -> Platform:
    """The platform of a device (the CPU's or CUDA's; any index)."""
    kind = torch.device(device).type
    if kind not in _PLATFORMS:
        raise ValueError(f"no platform for device {str(device)!r}; supported: cpu, cuda")
    return _PLATFORMS[kind]


def current_platform() -> Platform:
    """The platform of the device models are being built on (torch's default device)."""
    return platform_for(torch.get_default_device())


# ---- device and dtype choice ------------------------------------------------------------------
def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    platform = platform_for(device)
    if name == "auto":
        return platform.default_dtype()
    if name not in DTYPES:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    platform.check_dtype(DTYPES[name])
    return DTYPES[name]


# ---- memory -----------------------------------------------------------------------------------
def measure_cuda_memory(runner, max_num_batched_tokens: int) -> MemoryReading:
    """The CUDA platform's memory reading for the KV budget: run the largest step (ModelRunner's
    profile run, which releases its memory after), then read what the device has free and what
    this process holds. A tensor-parallel rank's peers must run the same profile at once."""
    peak = runner.profile_peak_activation_bytes(max_num_batched_tokens)
    torch.cuda.synchronize(runner.device)
    free, total = torch.cuda.mem_get_info(runner.device)
    # the weights, and what else stays allocated beside them (rotary tables, packed copies)
    weights = max(runner.weight_bytes(), torch.cuda.memory_allocated(runner.device))
    return MemoryReading(total=int(total), free=int(free), weights=int(weights), peak=int(peak),
                         own=int(torch.cuda.memory_reserved(runner.device)))

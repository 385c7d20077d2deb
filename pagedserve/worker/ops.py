"""The device-neutral ops bundle the models call (vLLM's CustomOp idea: forward_native /
forward_cpu / forward_cuda, here one class per implementation). A model holds the bundle its
platform gives it (pagedserve.worker.platform) and never learns the device.

    NativeOps      plain torch on any device: the reference the others must equal
    CpuKernelOps   the compiled C++ kernels (pagedserve/kernels/cpu): fused residual-add norm,
                   in-place rotary from the position tables, silu-and-mul, the small-row float32
                   matmul, LoRA's delta (each row its own adapter, in one pass); what they lack
                   stays native
    CudaOps        the fused Triton kernels (norm, rotary, activation, LoRA's grouped matmuls)

The ops:
  rms_norm(x, weight, eps, residual=None)  with residual: residual += x in place, then norm it
  rope(cos_table, sin_table, positions, dtype) -> the step's rotary argument (built once a step)
  rotary(q, k, rope) -> (q, k)             rotate-half rotary; may work in place
  silu_and_mul(x), gelu_and_mul(x)         act(x[..., :I]) * x[..., I:] (gelu: tanh approximation)
  linear(x, layer)                         a parallel linear layer (its reduce included), plus its
                                           LoRA adapters' deltas when the layer has some (`layer.lora`,
                                           worker/lora: set only with --enable-lora)
  logits(hidden, head)                     the LM head (a VocabParallelEmbedding)
`fused_residual_norm`: whether a decoder should run each residual add inside the norm after
it (DecoderLayer.forward_fused); numerically the same either way.

Stateless once built; safe from any thread.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.worker import parallel, process_group

SMALL_M = 8  # up to this many rows the CPU kernel's streaming matmul beats MKL (2-3x at 1-8 rows)


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: float32 statistics, cast back, then the weight."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def gathered_rope(cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (cos, sin) rows [T, 1, D] in the activation dtype (transformers' rounding)."""
    return cos_table[positions].to(dtype).unsqueeze(1), sin_table[positions].to(dtype).unsqueeze(1)


class NativeOps:
    """forward_native: plain torch."""

    name = "native"
    fused_residual_norm = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            residual.add_(x)
            x = residual
        return rms_norm_native(x, weight, eps)

    def rope(self, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        return gathered_rope(cos_table, sin_table, positions, dtype)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, *rope), apply_rotary(k, *rope)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def linear(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        out = self.base_linear(x, layer)
        lora = layer.lora
        if lora is None or lora.batch.mask is None:
            return out
        return self.lora_delta(lora, x, out)

    def base_linear(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        return layer(x)

    def lora_delta(self, lora, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + each row's adapter delta (worker/lora/layers.py: the grouped matmul)."""
        return lora.grouped_delta(x, out)

    def logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        return head.logits(hidden)


def use_small_m(x: torch.Tensor, layer: nn.Module) -> bool:
    """float32, few rows, a plain weight: small_m_linear, unless the layer's weight is packed for
    lane_linear (cpu_linear.py), which beat it 1.3-1.75x at 1-8 rows."""
    packed = getattr(layer, "packed", None)
    return (x.shape[0] <= SMALL_M and x.dtype == torch.float32 and x.shape[1] % 8 == 0
            and layer.quant is None and (packed is None or packed.lanes is None))


class CpuKernelOps(NativeOps):
    """forward_cpu: the compiled kernels (`kernels`, pagedserve.kernels.cpu_ops.load())."""

    name = "cpu-kernels"
    fused_residual_norm = True

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def rms_norm(self, x, weight, eps, residual=None):
        return self.kernels.rms_norm(x, weight, eps, residual)

    def rope(self, cos_table, sin_table, positions, dtype):
        return cos_table, sin_table, positions  # the kernel reads each token's row itself

    def rotary(self, q, k, rope):
        self.kernels.rotary_inplace(q, k, *rope)
        return q, k

    def silu_and_mul(self, x):
        return self.kernels.silu_and_mul(x)

    def base_linear(self, x, layer):
        if use_small_m(x, layer):
            out = self.kernels.small_m_linear(x.contiguous(), layer.weight)
            if isinstance(layer, parallel.RowParallelLinear) and layer.reduce:
                process_group.all_reduce(out)
            return out if layer.bias is None else out + layer.bias
        return layer(x)

    def lora_delta(self, lora, x, out):
        """Each row's own adapter only, in one pass (worker/lora/layers.py: packed_delta)."""
        if x.dtype not in self._lora_dtypes:
            return lora.grouped_delta(x, out)
        return lora.packed_delta(x, out, self.kernels)

    @functools.cached_property
    def _lora_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(dtype for dtype in (torch.float32, torch.bfloat16)
                     if self.kernels.lora_delta_available(dtype == torch.bfloat16))

    def logits(self, hidden, head):
        if use_small_m(hidden, head) and process_group.tp_group().world_size == 1:
            return self.kernels.small_m_linear(hidden.contiguous(), head.weight)
        return head.logits(hidden)


class CudaOps(NativeOps):
    """forward_cuda: the fused Triton kernels of pagedserve/kernels/triton/fused_ops.py, one launch each
    for the residual add and norm, the rotary of q and k together (in place, each token's table row
    read by the kernel), and the activation-and-mul; the matmuls stay torch's. Triton is imported on
    first use: importing this module must not load triton (the CPU's tests set TRITON_INTERPRET
    before they first import it)."""

    name = "cuda"
    fused_residual_norm = True

    @staticmethod
    def _kernels():
        from pagedserve.kernels.triton import fused_ops
        return fused_ops

    def rms_norm(self, x, weight, eps, residual=None):
        if x.dim() != 2 or x.stride(-1) != 1:
            return super().rms_norm(x, weight, eps, residual)
        return self._kernels().rms_norm(x, weight, eps, residual)

    def rope(self, cos_table, sin_table, positions, dtype):
        return cos_table, sin_table, positions  # the kernel reads each token's row itself

    def rotary(self, q, k, rope):
        self._kernels().rotary_inplace(q, k, *rope)
        return q, k

    def silu_and_mul(self, x):
        return self._act_and_mul(x, "silu")

    def gelu_and_mul(self, x):
        return self._act_and_mul(x, "gelu_tanh")

    def lora_delta(self, lora, x, out):
        from pagedserve.kernels.triton import lora as lora_kernels
        return lora.kernel_delta(x, out, lora_kernels)

    def _act_and_mul(self, x, activation):
        rows = x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.reshape(-1, x.shape[-1]).contiguous()
        return self._kernels().act_and_mul(rows, activation).view(*x.shape[:-1], x.shape[-1] // 2)

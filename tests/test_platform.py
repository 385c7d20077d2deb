"""The platform seam (pagedserve/worker/platform.py) and the ops bundle (pagedserve/worker/ops.py):
which platform a device gets, what each platform chooses (the CUDA one asked without a GPU: its
choices are pure logic), and the CPU kernels' ops equal to the native ones on random inputs."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_ops
from pagedserve.worker.attention import TritonAttentionBackend
from pagedserve.worker.torch_attention import CpuKernelAttentionBackend, TorchAttentionBackend
from pagedserve.worker.device_memory import MemoryReading, kv_budget
from pagedserve.worker.mla_attention import TorchMLABackend, TritonMLABackend
from pagedserve.worker.moe import GroupedTorchMoE, TritonMoE
from pagedserve.worker.ops import CpuKernelOps, CudaOps, NativeOps
from pagedserve.worker.parallel import ColumnParallelLinear, RowParallelLinear, Shard, VocabParallelEmbedding
from pagedserve.worker.platform import (
    CpuPlatform,
    CudaPlatform,
    current_platform,
    pick_device,
    pick_dtype,
    platform_for,
)

KERNELS = cpu_ops.load()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C++ compiler for the CPU kernels here")


def test_platform_of_a_device():
    assert isinstance(platform_for("cpu"), CpuPlatform) and isinstance(platform_for(torch.device("cpu")), CpuPlatform)
    assert isinstance(platform_for("cuda:1"), CudaPlatform) and platform_for("cuda") is platform_for("cuda:0")
    assert current_platform() is platform_for("cpu")  # the default device here
    with pytest.raises(ValueError, match="no platform for device 'meta'"):
        platform_for("meta")
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_dtype("auto", torch.device("cpu")) == CpuPlatform().default_dtype()
    assert pick_dtype("fp32", torch.device("cpu")) == torch.float32


def test_cpu_platform_choices():
    cpu = platform_for("cpu")
    expected = TorchAttentionBackend if KERNELS is None else CpuKernelAttentionBackend
    assert type(cpu.attention_backend()) is expected
    assert type(cpu.mla_backend()) is TorchMLABackend and type(cpu.moe_backend()) is GroupedTorchMoE
    assert cpu.dist_backend() == "gloo"
    assert cpu.rank_device(3, device_count=0, env={}) == torch.device("cpu")
    assert not cpu.measures_memory and cpu.measure_memory(None, 16) is None
    assert type(cpu.ops) is (NativeOps if KERNELS is None else CpuKernelOps)
    assert cpu.ops is platform_for("cpu").ops  # built once


def test_cuda_platform_choices_without_a_gpu(monkeypatch):
    cuda = platform_for("cuda")
    monkeypatch.delenv("PAGEDSERVE_ATTENTION", raising=False)
    assert type(cuda.attention_backend()) is TritonAttentionBackend
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "torch")
    assert type(cuda.attention_backend()) is TorchAttentionBackend
    assert type(cuda.mla_backend()) is TritonMLABackend and type(cuda.moe_backend()) is TritonMoE
    assert cuda.dist_backend() == "nccl"
    assert [str(cuda.rank_device(r, device_count=2, env={})) for r in (0, 1)] == ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError):  # rank 1 with one visible device
        cuda.rank_device(1, device_count=1, env={"CUDA_VISIBLE_DEVICES": "1"})
    assert cuda.measures_memory
    assert type(cuda.ops) is CudaOps and cuda.ops.fused_residual_norm  # the Triton residual-add norm
    gib = 1 << 30
    reading = MemoryReading(total=80 * gib, free=70 * gib, weights=10 * gib, peak=2 * gib, own=12 * gib)
    assert cuda.kv_budget(reading, 0.9, 1 << 20) == kv_budget(reading, 0.9, 1 << 20) > 0


def test_models_take_the_platforms_ops(tmp_path):
    from tiny_models import build_tiny_model

    from pagedserve.common.model_config import ModelConfig
    from pagedserve.worker.models import model_class
    cfg = ModelConfig.from_folder(build_tiny_model(tmp_path, "llama"))
    model = model_class(cfg.architecture)(cfg, platform_for("cpu").attention_backend(), 64)
    bundles = {id(m.ops) for m in model.modules() if hasattr(m, "ops")}
    assert bundles == {id(platform_for("cpu").ops)} and len([m for m in model.modules() if hasattr(m, "ops")]) > 3
    assert model.fused_norms == (KERNELS is not None)  # the CPU kernels fuse each residual add into its norm


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rand(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_ops_equal_native(dtype):
    native, fast = NativeOps(), CpuKernelOps(KERNELS)
    gen = torch.Generator().manual_seed(0)
    tol = TOL[dtype]

    def close(a, b):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)

    tokens, hidden = 5, 64
    x, w = rand(tokens, hidden, dtype=dtype, gen=gen, scale=3), rand(hidden, dtype=dtype, gen=gen, scale=0.5) + 1
    close(fast.rms_norm(x, w, 1e-6), native.rms_norm(x, w, 1e-6))
    residual = rand(tokens, hidden, dtype=dtype, gen=gen)
    r_fast, r_native = residual.clone(), residual.clone()
    close(fast.rms_norm(x, w, 1e-6, r_fast), native.rms_norm(x, w, 1e-6, r_native))
    assert torch.equal(r_fast, r_native) and torch.equal(r_native, residual + x)  # the add, in place

    heads, kv_heads, head_dim, positions = 4, 2, 32, torch.tensor([0, 3, 7, 1, 63])
    angles = torch.outer(torch.arange(64, dtype=torch.float32), torch.rand(head_dim // 2, generator=gen))
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q, k = rand(tokens, heads, head_dim, dtype=dtype, gen=gen), rand(tokens, kv_heads, head_dim, dtype=dtype, gen=gen)
    q_fast, k_fast = fast.rotary(q.clone(), k.clone(), fast.rope(cos, sin, positions, dtype))
    q_native, k_native = native.rotary(q, k, native.rope(cos, sin, positions, dtype))
    close(q_fast, q_native)
    close(k_fast, k_native)

    gate_up = rand(tokens, 2 * 48, dtype=dtype, gen=gen)
    close(fast.silu_and_mul(gate_up), native.silu_and_mul(gate_up))
    close(fast.gelu_and_mul(gate_up), native.gelu_and_mul(gate_up))

    column = ColumnParallelLinear(hidden, [Shard(0, 40)], bias=True)
    row = RowParallelLinear(hidden, 24, bias=True)
    head = VocabParallelEmbedding(96, hidden)
    for layer in (column, row, head):
        layer.to(dtype)
        for p in layer.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    for rows in (1, 3, 8, 20):  # the small-row kernel (float32, up to 8 rows) and the library matmul
        h = rand(rows, hidden, dtype=dtype, gen=gen)
        close(fast.linear(h, column), native.linear(h, column))
        close(fast.linear(h, row), native.linear(h, row))
        close(fast.logits(h, head), native.logits(h, head))

"""4-bit checkpoint weights kept 4-bit on the GPU (worker/int4_weight.py, kernels/triton/int4_matmul.py): the
kernel against its torch reference, the conversion from ggml's Q4_0 / Q4_1 blocks against the CPU kernels'
own dequantization, and the engine in the "int4" mode (what --quantization auto is on CUDA for such a
checkpoint) against transformers on the blocks' weights. Without CUDA the kernel runs under the Triton
interpreter (TRITON_INTERPRET=1, set before triton is first imported)."""

from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import save_file

from triton_device import triton_device  # sets up the interpreter before triton.language is imported

DEVICE = triton_device()

from pagedserve.kernels import reference  # noqa: E402
from pagedserve.kernels.triton.int4_matmul import int4_linear  # noqa: E402
from pagedserve.worker import int4_weight, quantized  # noqa: E402
from pagedserve.worker.scaled_weights import q4_blocks  # noqa: E402
from test_gptq_checkpoints import gptq_checkpoint  # noqa: E402
from test_scaled_checkpoints import awq_checkpoint, check_equals_transformers  # noqa: E402
from tiny_models import make_engine  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def random_layout(gen, n: int, k: int, group: int):
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), dtype=torch.int32, generator=gen)
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).half()
    offsets = (torch.randn(k // group, n, generator=gen) * 0.1).half()
    return words.to(DEVICE), scales.to(DEVICE), offsets.to(DEVICE)


ON_GPU_ONLY = pytest.mark.skipif(DEVICE == "cpu", reason="the interpreter's bfloat16 tl.dot is wrong")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=ON_GPU_ONLY)])
@pytest.mark.parametrize("m, n, k, group", [(1, 48, 64, 32), (5, 130, 96, 32), (33, 64, 256, 128), (17, 40, 64, 64)])
def test_int4_linear_equals_its_reference(dtype, m, n, k, group):
    gen = torch.Generator().manual_seed(m + n + k)
    layout = random_layout(gen, n, k, group)
    x = torch.randn(m, k, generator=gen).to(device=DEVICE, dtype=dtype)
    got, want = int4_linear(x, *layout), reference.int4_linear(x, *layout)
    assert got.dtype == dtype and got.shape == (m, n)
    scale = max(1.0, want.float().abs().max().item())
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype] * scale
    assert int4_linear(x, *layout, out_dtype=torch.float32).dtype == torch.float32


def test_the_reference_reads_gptqs_layout():
    """Word w of column n holds inputs 8w..8w+7, input 8w + i at bits 4i (GPTQ's qweight)."""
    q = torch.randint(0, 16, (64, 3))  # [K, N]
    words = (q.reshape(8, 8, 3) << (torch.arange(8) * 4).view(1, 8, 1)).sum(1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    ones, zeros = torch.ones(2, 3, dtype=torch.float16), torch.zeros(2, 3, dtype=torch.float16)
    assert torch.equal(reference.int4_weight(words, ones, zeros), q.t().float())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_blocks_convert_exactly(qtype):
    from pagedserve.kernels import cpu_ops
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (24, 128), generator=gen)
    scale = torch.rand(24, 4, generator=gen) * 0.02
    zero = torch.randint(0, 16, (24, 4), generator=gen) if qtype == "Q4_1" else None
    blocks = q4_blocks(q, scale, zero)
    assert blocks.qtype == GGMLQuantizationType[qtype]
    assert torch.equal(int4_weight.dequantize_q4(blocks, torch.float32), blocks.dequantize(cpu_ops.load(),
                                                                                             torch.float32))


def test_auto_is_int4_on_cuda_for_a_checkpoints_4_bit_blocks_only():
    cuda = torch.device("cuda")  # resolve reads the device's type only
    assert quantized.resolve("auto", cuda, True, True) == "int4"
    assert quantized.resolve("auto", cuda, True, False) == "none"  # a GGUF on CUDA: dequantized, as before
    assert quantized.resolve("none", cuda, True, True) == "none"
    assert quantized.resolve("auto", torch.device("cpu"), True, True) == "gguf"  # the CPU kernels'
    assert quantized.resolve("int4", torch.device("cpu"), True, True) == "int4"  # by name: the interpreter


def blocks_reference(folder, tmp_path):
    """The checkpoint's weights as the kept blocks dequantize (float16 d and m), saved plain: what the int4
    kernel multiplies."""
    from pagedserve.kernels import cpu_ops
    from pagedserve.worker.quantized import QuantizedTensor
    from pagedserve.worker.weights import iter_lazy_weights
    ref = tmp_path / "blocks-dequantized"
    ref.mkdir()
    state = {}
    for name, lazy in iter_lazy_weights(folder, torch.float32, False, True):
        t = lazy.full()
        state[name] = t.dequantize(cpu_ops.load(), torch.float32) if isinstance(t, QuantizedTensor) else t
    save_file({k: v.contiguous() for k, v in state.items()}, ref / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    (ref / "config.json").write_text(json.dumps(config))
    return ref


@pytest.mark.parametrize("kind, qtype", [("gptq-symmetric", "Q4_0"), ("gptq-act-order", "Q4_0"), ("awq", "Q4_1"),
                                         ("awq-qwen3_moe", "Q4_1")])
def test_the_engine_on_the_int4_kernel_equals_transformers(tmp_path, kind, qtype):
    if kind.startswith("awq"):
        folder, _ = awq_checkpoint(tmp_path, zero_point=True, arch="qwen3_moe" if kind.endswith("moe") else "llama")
    else:  # act order: each layer's inputs gathered by group before the kernel (one order for q/k/v, gate/up)
        folder, _ = gptq_checkpoint(tmp_path, symmetric=True, act_order=kind.endswith("order"), shared_order=True)
    with make_engine(folder, quantization="int4") as engine:
        assert engine.runner.quantization == "int4"
        description = engine.runner.weights_description
        assert description.startswith("quantized on the int4 kernel (") and qtype in description
        assert "kept from the checkpoint's" in description
        # 4 bits a weight and 32 bits of scale and offset a group of 32: 5 bits of the float32 load's 32
        linear = [m for m in engine.runner.model.modules() if isinstance(getattr(m, "quant", None),
                                                                       int4_weight.Int4Weight)]
        assert linear and all(sum(m.quant.row_counts) == m.quant.qweight.shape[1] for m in linear)
        assert all((m.quant.input_order is not None) == kind.endswith("order") for m in linear)
        assert sum(m.quant.nbytes for m in linear) * 8 == sum(m.quant.qweight.numel() * 8 for m in linear) * 5
        assert engine.runner.weight_bytes() > 0
    # two ranks on the dense one: q/k/v and gate/up by output rows, o and down by whole blocks of inputs (in act
    # order, no run of groups: float)
    check_equals_transformers(folder, blocks_reference(folder, tmp_path), ranks=1 if kind.startswith("awq") else 2,
                              quantization="int4", description="quantized on the int4 kernel")

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
    assert quantized.resolve("auto", cuda, True, False) == "none"  # nothing the int4 kernel takes: dequantized
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


def test_q4_k_blocks_convert_exactly():
    """Q4_K's sub-blocks of 32 as groups of 32 with float32 scales d * sc and offsets -dmin * m: the weight
    equals the gguf package's dequantization bit for bit, and the kernel multiplies it."""
    import numpy as np
    from gguf.quants import dequantize

    from pagedserve.worker.quantized import QuantizedTensor
    from test_quant_kernels import random_blocks
    blocks = random_blocks("Q4_K", 40, 512, np.random.default_rng(5))
    want = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q4_K).reshape(40, 512).copy())
    t = QuantizedTensor(torch.from_numpy(blocks), GGMLQuantizationType.Q4_K, 512)
    layout = int4_weight.from_q4k_blocks(t)
    assert layout[1].dtype == torch.float32 and layout[1].shape == (16, 40)
    assert torch.equal(int4_weight.dequantize_q4(t, torch.float32), want)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    got = int4_linear(x.to(DEVICE), *(p.to(DEVICE) for p in layout)).cpu()
    assert (got - x @ want.T).abs().max().item() <= 1e-4 * max(1.0, (x @ want.T).abs().max().item())


def test_a_gguf_on_the_int4_kernel_equals_its_float_load(tmp_path):
    """A GGUF's Q4_0, Q4_1 and Q4_K matrices on the int4 kernel (what --quantization auto is on CUDA for a
    GGUF), the rest dequantized: a layer with a part not 4-bit (V in Q5_0, as a Q4_K_M file stores some V rows in
    Q6_K), down in Q8_0, and the
    embedding; gate (Q4_K) beside up (Q4_1) takes float32 scales. Greedy tokens and logprobs equal the float
    load's (--quantization none)."""
    import gguf

    from pagedserve.common.sampling_params import SamplingParams
    from pagedserve.model_files.gguf_loader import gguf_to_hf_config
    from test_gguf_loader import write_tiny_gguf
    from test_quantized_model import requantize_gguf
    f32 = tmp_path / "f32.gguf"
    write_tiny_gguf(f32, "llama", tie=True, hidden_size=256, intermediate_size=512)
    folder = tmp_path / "model"
    folder.mkdir()
    Q = gguf.GGMLQuantizationType
    requantize_gguf(f32, folder / "model.gguf", {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q5_0,
                                                 "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_1,
                                                 "ffn_down": Q.Q8_0, "token_embd": Q.Q4_K},
                    random_kinds=frozenset({"attn_q", "attn_k", "ffn_gate", "token_embd"}))
    (folder / "config.json").write_text(json.dumps(gguf_to_hf_config(folder / "model.gguf")))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompt = [5, 17, 33, 60, 2, 99, 41]
    with make_engine(folder, quantization="int4") as engine:
        assert engine.runner.quantization == "int4"
        assert engine.runner.weights_description.startswith(
            "quantized on the int4 kernel (2 Q4_0, 2 Q4_1, 2 Q4_K matrices)")  # o; gate and up; qkv, down float
        kept = [m.quant for m in engine.runner.model.modules() if isinstance(getattr(m, "quant", None),
                                                                            int4_weight.Int4Weight)]
        assert sorted(str(q.scales.dtype) for q in kept) == ["torch.float16"] * 2 + ["torch.float32"] * 2
        got = engine.generate([prompt], params)[0][0]
    with make_engine(folder) as plain:
        want = plain.generate([prompt], params)[0][0]
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)

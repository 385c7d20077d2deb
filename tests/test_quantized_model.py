"""Models served with their linear weights quantized (pagedserve.worker.quantized) against the same
weights dequantized: a tiny GGUF in every kernel format, --quantization int8 on a tiny HF folder,
and the default model (Q4_1) teacher-forced over 1,000 tokens, with each one's resident memory.

The quantized kernel rounds activations to int8 (a scale per 32 values), so logits differ slightly
from the float model's; what must hold is the top-1 token at (nearly) every position.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.kernels import cpu_ops
from pagedserve.worker.quantized import QuantizedTensor, quantize_q8_0
from tests.test_gguf_loader import write_tiny_gguf
from tests.tiny_models import make_engine

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="no C++ compiler for the CPU kernels here")
AGREEMENT = 0.98


def top1(engine, prompts: list[list[int]]) -> list[int]:
    """The model's top-1 prediction after every prompt position (teacher forcing)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    out = []
    for samples in engine.generate(prompts, params):
        out += [t.top_logprobs[0][0] for t in samples[0].prompt_logprobs]
    return out


def agreement(a: list[int], b: list[int]) -> float:
    assert len(a) == len(b) and a
    return sum(x == y for x, y in zip(a, b)) / len(a)


def requantize_gguf(src: Path, dst: Path, qtypes: dict[str, gguf.GGMLQuantizationType],
                    random_kinds: frozenset[str] = frozenset()) -> None:
    """Rewrite an F32 GGUF with the 2-D weights quantized, the format chosen by tensor kind; random_kinds:
    those kinds' tensors are random blocks of their format instead (the gguf package cannot quantize to the
    K-quants), with scales small enough for a model that stays finite."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        data = np.array(t.data, dtype=np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.split(".")[0]
        qtype = qtypes.get(kind) if data.ndim == 2 else None
        if qtype is None:
            writer.add_tensor(t.name, data)
        elif kind in random_kinds:
            writer.add_tensor(t.name, random_k_blocks(data.shape, qtype, len(reader.tensors)), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_k_blocks(shape: tuple[int, int], qtype: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    """uint8 [rows, bytes] of random Q4_K blocks (values, 6-bit scales and mins) with d and dmin ~0.002."""
    assert qtype == gguf.GGMLQuantizationType.Q4_K
    rng = np.random.default_rng(seed + shape[0] * 7 + shape[1])
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // 256, 144), dtype=np.uint8)
    for offset in (0, 2):
        halves = (rng.uniform(0.001, 0.003, len(blocks))).astype(np.float16)
        blocks[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(shape[0], -1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_quantized_agrees_with_dequantized(tmp_path, arch):
    f32 = tmp_path / "f32.gguf"
    write_tiny_gguf(f32, arch, tie=True)
    folder = tmp_path / "model"
    folder.mkdir()
    Q = gguf.GGMLQuantizationType
    # one format per kind; q and k (permuted rows) in two different ones, merged with v's
    requantize_gguf(f32, folder / "model.gguf", {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1,
                                                 "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1,
                                                 "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0})
    from pagedserve.model_files.gguf_loader import gguf_to_hf_config
    (folder / "config.json").write_text(json.dumps(gguf_to_hf_config(folder / "model.gguf")))
    quant = make_engine(folder, quantization="auto")
    assert quant.runner.quantization == "gguf" and "Q4_1" in quant.runner.weights_description
    plain = make_engine(folder)
    assert plain.runner.weights_description == "float"
    assert quant.runner.weight_bytes() < plain.runner.weight_bytes() / 2
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, 40).tolist() for _ in range(4)]
    # random weights give near ties; a wrong row order or format would agree ~1/128 of the time
    assert agreement(top1(quant, prompts), top1(plain, prompts)) >= 0.9


def test_int8_on_an_hf_folder(tiny_llama):
    quant = make_engine(tiny_llama, quantization="int8")
    plain = make_engine(tiny_llama)
    assert quant.runner.quantization == "int8" and "Q8_0" in quant.runner.weights_description
    auto = make_engine(tiny_llama, quantization="auto")
    assert auto.runner.weights_description == "float"  # an HF folder stays float by default
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 100, 30).tolist() for _ in range(4)]
    assert agreement(top1(quant, prompts), top1(plain, prompts)) >= 0.9


def test_quantized_tensor_splits_on_block_boundaries():
    q = quantize_q8_0(torch.randn(6, 128))
    assert q.narrow(0, 2, 3).shape == (3, 128)
    half = q.narrow(1, 64, 64)
    ops = cpu_ops.load()
    assert torch.equal(half.dequantize(ops, torch.float32), q.dequantize(ops, torch.float32)[:, 64:])
    with pytest.raises(ValueError, match="does not fall on Q8_0 blocks of 32"):
        q.narrow(1, 48, 48)
    assert isinstance(q.permute_rows(torch.tensor([5, 4, 3, 2, 1, 0])), QuantizedTensor)


# ---- the default model: Q4_1 kept quantized vs dequantized float32 ----------------------------

_MEASURE = """
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.test_quantized_model import top1
from tests.tiny_models import make_engine
engine = make_engine(Path({model!r}), tokenizer=None, quantization={quant!r}, kv_cache_memory="96MiB",
                     max_num_batched_tokens={budget})
ids = top1(engine, json.loads(Path({prompts!r}).read_text()))
rss = next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS"))
print(json.dumps({{"top1": ids, "rss_mib": rss / 1024, "weights": engine.runner.weights_description}}))
"""


def measure(model: Path, quant: str, prompts_file: Path) -> dict:
    """top-1 ids and resident memory of an engine alone in a fresh process (one worker's RSS)."""
    # Chunks of 8 tokens: the quantized kernel's rows (more rows dequantize: quantized.DEQUANTIZE_ABOVE)
    code = _MEASURE.format(root=str(Path(__file__).parents[1]), model=str(model), quant=quant,
                           prompts=str(prompts_file), budget=8 if quant != "none" else 512)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def english_text() -> str:
    """Deterministic prose shipped with Python: the standard library's module docstrings."""
    import argparse, collections, email, json as json_mod, logging, subprocess as sp, threading, unittest  # noqa
    return "\n\n".join(m.__doc__ for m in (argparse, collections, email, json_mod, logging, sp, threading, unittest))


def check_agreement(model_path: Path, tmp_path: Path, formats: tuple[str, ...]) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_path).encode(english_text())
    assert len(ids) >= 1002
    prompts = [ids[i * 501:(i + 1) * 501] for i in range(2)]  # 2 x 500 predicted positions
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    quant = measure(model_path, "auto", prompts_file)
    plain = measure(model_path, "none", prompts_file)
    rate = agreement(quant["top1"], plain["top1"])
    print(f"\n{model_path.name}, {len(plain['top1'])} teacher-forced positions: top-1 agreement {rate:.4f}; "
          f"worker RSS quantized ({quant['weights']}) {quant['rss_mib']:.0f} MiB, "
          f"dequantized float32 {plain['rss_mib']:.0f} MiB")
    assert len(plain["top1"]) == 1000
    assert all(f in quant["weights"] for f in formats), quant["weights"]
    assert rate >= AGREEMENT


@pytest.mark.slow
def test_default_model_quantized_top1_agreement(default_model_path, tmp_path):
    check_agreement(default_model_path, tmp_path, ("Q4_1", "Q8_0"))


@pytest.mark.slow
@pytest.mark.heavy  # Gemma 3 270M in float32 over 2,000 positions: `make test-heavy`
def test_gemma3_quantized_top1_agreement(tmp_path):
    from pagedserve.model_files.default_model import ensure_named_model
    check_agreement(ensure_named_model("gemma3-270m", progress=False), tmp_path, ("Q4_K", "Q5_0", "Q6_K", "Q8_0"))

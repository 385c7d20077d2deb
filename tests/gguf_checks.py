"""Checks the GGUF architecture tests share (tests/test_olmo2_gguf.py, test_cohere_gguf.py,
test_starcoder2_gguf.py): a GGUF's weights as pagedserve reads them against the model it was written from,
and its prepared folder's greedy tokens against transformers' on that model, whole and chunked."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.model_files.gguf_loader import prepare_gguf_folder
from pagedserve.worker.gguf_weights import iter_gguf_weights
from test_qwen3_phi3 import LENGTHS, MAX_NEW, PROMPTS, run
from tiny_models import hf_greedy, make_engine


def check_weights_equal(path: Path, expected: dict[str, torch.Tensor]) -> None:
    """Every tensor of the GGUF at `path`, read in float32, equals `expected`'s of its name; no more, no fewer."""
    got = dict(iter_gguf_weights(path, torch.float32))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def check_serves_like_transformers(folder: Path, path: Path, tmp_path: Path, inspect=None) -> None:
    """The GGUF's prepared folder gives transformers' greedy tokens on `folder` (the model it was written from),
    whole and with chunked prefill; inspect(engine), when given, looks at the whole-prompt engine first."""
    prepared = prepare_gguf_folder(path, tmp_path / "prepared")
    expected = hf_greedy(folder, PROMPTS, MAX_NEW)
    for overrides in ({}, {"max_num_batched_tokens": 16}):
        with make_engine(prepared, **overrides) as engine:
            if inspect is not None and not overrides:
                inspect(engine)
            got = run(engine)
        for length, ours, theirs in zip(LENGTHS, got, expected):
            assert ours == theirs, f"prompt of {length} tokens, {overrides}"


def check_q8_rows_agree_with_dequantized(path: Path, tmp_path: Path, tensors: list[str]) -> None:
    """The file with `tensors` (GGUF names: "attn_q", "ffn_up", ...) requantized to Q8_0 and kept so
    (quantization auto) picks the same next tokens as the file dequantized, on 3 x 40 random ids: a wrong
    row order would agree about 1/256 of the time."""
    import json

    import gguf
    import numpy as np

    from pagedserve.model_files.gguf_loader import gguf_to_hf_config
    from test_quantized_model import agreement, requantize_gguf, top1
    folder = tmp_path / "model"
    folder.mkdir()
    requantize_gguf(path, folder / "model.gguf", {name: gguf.GGMLQuantizationType.Q8_0 for name in tensors})
    (folder / "config.json").write_text(json.dumps(gguf_to_hf_config(folder / "model.gguf")))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, 40).tolist() for _ in range(3)]
    with make_engine(folder, quantization="auto") as quant, make_engine(folder) as plain:
        assert quant.runner.quantization == "gguf" and "Q8_0" in quant.runner.weights_description
        assert agreement(top1(quant, prompts), top1(plain, prompts)) >= 0.9

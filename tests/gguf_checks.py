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

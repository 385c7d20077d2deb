"""`pagedserve bench quality` on a tiny model: a run against itself loses nothing, the perplexity is
transformers' over the same windows, and another dtype shows a small loss."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.bench import quality

ROOT = Path(__file__).resolve().parent.parent


def test_windows_are_whole_and_start_with_bos():
    ids = list(range(10, 31))  # 21 tokens: two windows of 8, the 5 left over dropped
    assert quality.windows_of(ids, 8, None) == [list(range(10, 18)), list(range(18, 26))]
    assert quality.windows_of(ids, 8, 1)[1] == [1, *range(19, 26)]
    assert quality.scored_range(8) == (4, 7)
    with pytest.raises(ValueError, match="fewer than one window"):
        quality.windows_of(ids, 32, None)


def test_parse_llama_perplexity():
    out = "[1]9.8,[2]10.1,\nFinal estimate: PPL = 10.0623 +/- 0.41210\n"
    assert quality.parse_llama_perplexity(out) == pytest.approx(10.0623)
    with pytest.raises(ValueError, match="Final estimate"):
        quality.parse_llama_perplexity("nothing")


def test_sample_text_ships():
    assert len(quality.sample_text()) > 10_000


def hf_perplexity(folder: Path, windows: list[list[int]]) -> float:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    first, last = quality.scored_range(len(windows[0]))
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = model(torch.tensor([w])).logits[0, first:last].double()
            targets = torch.tensor(w[first + 1:last + 1])
            nll -= torch.log_softmax(logits, -1).gather(1, targets[:, None]).sum().item()
            count += targets.numel()
    return math.exp(nll / count)


@pytest.mark.slow  # the default model's tokenizer
def test_bench_quality_against_itself_and_transformers(tmp_path, default_model_path):
    from service_stack import tiny_model_with_tokenizer
    from transformers import AutoTokenizer

    folder = tiny_model_with_tokenizer(tmp_path / "llama", default_model_path)
    text = tmp_path / "text.txt"
    text.write_text(quality.sample_text()[:2000])
    out = tmp_path / "q.json"
    cmd = [sys.executable, "-m", "pagedserve.cli", "bench", "quality", "--model", str(folder), "--text", str(text),
           "--ctx", "64", "--dtype", "float32", "--quantization", "none", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert set(quality.KEYS) <= set(got)
    assert got["kl_mean"] == pytest.approx(0, abs=1e-9) and got["top1_agreement"] == 1 and got["max_logit_diff"] == 0
    ids = AutoTokenizer.from_pretrained(folder)(text.read_text(), add_special_tokens=False)["input_ids"]
    windows = quality.windows_of(ids, 64, None)
    assert got["windows"] == len(windows) >= 4 and got["scored_tokens"] == len(windows) * 31
    assert got["perplexity"] == pytest.approx(hf_perplexity(folder, windows), rel=1e-4)
    assert "pagedserve float32 none" in proc.stdout


@pytest.mark.slow
def test_bfloat16_loses_a_little_against_float32(tmp_path, default_model_path):
    """In process, the comparison itself: bfloat16 against the float32 reference of the same weights."""
    from service_stack import tiny_model_with_tokenizer
    from tiny_models import make_engine
    from transformers import AutoTokenizer

    folder = tiny_model_with_tokenizer(tmp_path / "llama", default_model_path)
    ids = AutoTokenizer.from_pretrained(folder)(quality.sample_text()[:1000], add_special_tokens=False)["input_ids"]
    tested, reference = make_engine(folder, dtype="bfloat16"), make_engine(folder)
    got = quality.compare(tested.runner, reference.runner, quality.windows_of(ids, 64, None))
    assert 0 < got["kl_mean"] < 0.05 and 0 < got["max_logit_diff"] < 1 and got["top1_agreement"] > 0.8
    assert got["perplexity"] == pytest.approx(got["reference_perplexity"], rel=0.05)


def test_gemma3_sliding_and_global_layers_match_transformers(tmp_path, monkeypatch):
    """A model whose KV groups differ per layer (tiny Gemma 3: local layers with an 8-token window,
    global layers) runs its windows through the serving runner's per-group tables: the perplexity is
    transformers' over the same windows (each window 4x the sliding window, not a multiple of the
    block size), a run against itself loses nothing, and bfloat16 loses a little."""
    from tiny_models import build_tiny_model, make_engine

    folder = build_tiny_model(tmp_path / "gemma3", "gemma3")
    reference = make_engine(folder)
    assert reference.runner.config.kv_groups().hybrid
    ids = torch.randint(3, 256, (5 * 40,), generator=torch.Generator().manual_seed(0)).tolist()
    windows = quality.windows_of(ids, 40, 1)
    monkeypatch.setattr(quality, "SCORE_ROWS", 7)  # each window's 19 scored rows in three pieces
    itself = quality.compare(reference.runner, reference.runner, windows)
    assert itself["kl_mean"] == 0 and itself["top1_agreement"] == 1 and itself["scored_tokens"] == 5 * 19
    assert itself["perplexity"] == pytest.approx(hf_perplexity(folder, windows), rel=1e-4)
    got = quality.compare(make_engine(folder, dtype="bfloat16").runner, reference.runner, windows)
    assert 0 < got["kl_mean"] < 0.05 and got["top1_agreement"] > 0.8
    assert got["perplexity"] == pytest.approx(got["reference_perplexity"], rel=0.05)


def test_bos_is_what_the_tokenizer_puts_first():
    """Gemma's tokenizer adds BOS by its post-processor, with add_bos_token False: asked of an
    encoding, the windows start with it (without it Gemma 3 scored far worse than llama.cpp)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "x": 1, "y": 2}

    def tokenizer(adds_bos: bool):
        t = Tokenizer(models.WordLevel(vocab, unk_token="x"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        if adds_bos:
            t.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
        return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<bos>")

    gemma_like = tokenizer(True)
    assert not getattr(gemma_like, "add_bos_token", False) and gemma_like("y")["input_ids"] == [0, 2]
    assert quality.leading_bos(gemma_like) == 0
    assert quality.leading_bos(tokenizer(False)) is None

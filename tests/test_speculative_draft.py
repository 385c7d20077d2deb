"""Speculative decoding with a draft model (--speculative-config method draft_model): greedy output
equals the engine's without speculation, token for token in float32, across batching, chunked
prefill, preemption by recompute and swap, and prefix-cache hits; the block pool's bookkeeping
holds after every step and nothing is left held. The target as its own draft accepts every
proposal: that shows the draft's KV cache (in the target's blocks) in step with the target's
through all of those paths, prefix hits and swaps included. A bad draft (another vocabulary, a
missing folder) is refused before anything loads. (TP 2: tests/test_tensor_parallel.py; the
n-gram method: tests/test_speculative.py.)"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.speculative import parse_speculative_config
from test_engine_equivalence import random_prompts
from test_speculative import generate_checked, greedy
from tiny_models import build_tiny_model, make_engine

BLOCK_BYTES = 8192  # one block of the tiny llama's KV (and of each draft here)


def draft_spec(draft, k: int = 4) -> dict:
    return {"model": str(draft), "num_speculative_tokens": k, "disable_by_batch_size": 0}  # method implied


@pytest.fixture(scope="module")
def case(tiny_llama):
    """test_speculative's prompts (two of them repeat themselves) and the engine's greedy tokens
    without speculation (those equal transformers': test_speculative.py, test_engine_equivalence.py)."""
    rng = np.random.default_rng(7)
    prompts = random_prompts(6, 256, seed=5) + [[5, 6, 7, 8, 9, 10] * 8, rng.integers(3, 256, 12).tolist() * 4]
    plain, _ = generate_checked(make_engine(tiny_llama, kv_cache_memory=128 * BLOCK_BYTES), prompts, greedy())
    return tiny_llama, prompts, [samples[0] for samples in plain]


@pytest.fixture(scope="module")
def near_draft(tiny_llama, tmp_path_factory):
    """A different model of the same vocabulary that often agrees with the target: its weights
    plus a little noise (about 60% of the proposals accepted)."""
    folder = tmp_path_factory.mktemp("near-draft")
    shutil.copytree(tiny_llama, folder, dirs_exist_ok=True)
    weights = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    weights = {name: w + 0.005 * torch.randn(w.shape, generator=gen) if w.dim() == 2 else w
               for name, w in weights.items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def engine_with(folder, draft, blocks: int = 128, **overrides):
    # Each block holds the draft's K/V beside the target's: the pool is twice the bytes for as many blocks.
    return make_engine(folder, speculative_config=draft_spec(draft), kv_cache_memory=2 * blocks * BLOCK_BYTES,
                       **overrides)


def run_equal(engine, prompts, expected) -> dict:
    got, _ = generate_checked(engine, prompts, greedy())
    assert [samples[0] for samples in got] == expected
    return engine.stats()["spec_decode"]


def test_self_draft_accepts_everything_across_batching_and_prefix_hits(case):
    folder, prompts, expected = case
    engine = engine_with(folder, folder, block_size=4)
    stats = run_equal(engine, prompts[-2:], expected[-2:])
    hits_before = engine.stats()["prefix_cache_hits"]
    stats = run_equal(engine, prompts, expected)
    assert engine.stats()["prefix_cache_hits"] - hits_before >= 2 * 40  # the draft's K/V came with the hits
    assert stats["num_draft_tokens"] > 100 and stats["acceptance_rate"] == 1.0, stats


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_self_draft_through_preemption(case, mode):
    folder, prompts, expected = case
    engine = engine_with(folder, folder, blocks=24, preemption_mode=mode, swap_space=2 * 64 * BLOCK_BYTES)
    stats = run_equal(engine, prompts, expected)
    assert engine.stats()["num_preemptions"] > 0
    assert stats["acceptance_rate"] == 1.0, stats  # swapped and recomputed draft K/V are right


def test_near_draft_with_chunked_prefill_and_rejections(case, near_draft):
    folder, prompts, expected = case
    engine = engine_with(folder, near_draft, max_num_batched_tokens=16, block_size=4, max_num_seqs=4)
    stats = run_equal(engine, prompts, expected)
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats  # both kept and rejected
    assert stats["accepted_per_pos"][3] > 0


def test_seeded_samples_and_forks_equal_without_speculation(case, near_draft):
    folder, prompts, _ = case
    prompts = prompts[-3:]
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=12, ignore_eos=True, seed=100 + i, n=2)
              for i in range(len(prompts))]
    plain, _ = generate_checked(make_engine(folder, kv_cache_memory=128 * BLOCK_BYTES), prompts, params)
    engine = engine_with(folder, near_draft)
    got, _ = generate_checked(engine, prompts, params)
    assert got == plain  # the forks' copied blocks carry the draft's K/V too
    assert engine.stats()["spec_decode"]["num_accepted_tokens"] > 0


def test_draft_of_another_architecture(case, tiny_qwen2):
    folder, prompts, expected = case
    engine = engine_with(folder, tiny_qwen2)
    assert engine.scheduler.block_manager.num_total_blocks == 128  # the budget counts both caches
    stats = run_equal(engine, prompts[:4], expected[:4])
    assert stats["num_drafts"] > 0


def test_bad_drafts_are_refused_before_loading(tiny_llama, tmp_path):
    spec = parse_speculative_config({"model": "x", "num_speculative_tokens": 2})
    assert (spec.method, spec.draft_model, spec.num_speculative_tokens) == ("draft_model", "x", 2)
    other_vocab = build_tiny_model(tmp_path / "vocab", "llama", vocab_size=300, num_hidden_layers=1)
    with pytest.raises(ValueError, match="draft's vocab_size 300 differs from the target model's 256"):
        make_engine(tiny_llama, speculative_config=draft_spec(other_vocab))
    with pytest.raises(ValueError, match="model '/nonexistent/draft': the draft model cannot be used"):
        make_engine(tiny_llama, speculative_config=draft_spec("/nonexistent/draft"))
    short = build_tiny_model(tmp_path / "short", "llama", max_position_embeddings=64, num_hidden_layers=1)
    with pytest.raises(ValueError, match="max_position_embeddings 64 is shorter than the target's max_model_len"):
        make_engine(tiny_llama, speculative_config=draft_spec(short))
    bad = {'{"method": "draft_model", "num_speculative_tokens": 2}': "'draft_model' needs model",
           '{"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}':
               r"unknown field\(s\) prompt_lookup_max for method 'draft_model'"}
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            parse_speculative_config(text)

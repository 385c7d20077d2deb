"""Greedy outputs equal transformers' token for token, whatever batching, chunking, preemption
or prefix caching happened."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.common.sampling_params import SamplingParams
from tiny_models import build_tiny_model, hf_greedy, make_engine

MAX_NEW = 24


def random_prompts(num: int, vocab: int, seed: int = 0, low: int = 2, high: int = 90) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(low, high, num)]


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(engine, prompts, max_tokens=MAX_NEW):
    return [samples[0].token_ids for samples in engine.generate(prompts, greedy(max_tokens))]


@pytest.fixture(scope="module")
def llama_case(tiny_llama):
    prompts = random_prompts(10, 256)
    return tiny_llama, prompts, hf_greedy(tiny_llama, prompts, MAX_NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_batch_matches_transformers(arch, tiny_llama, tiny_qwen2, tmp_path):
    folder = {"llama": tiny_llama, "qwen2": tiny_qwen2}.get(arch) or build_tiny_model(tmp_path, arch)
    prompts = random_prompts(9, 256, seed=1)
    assert len({len(p) for p in prompts}) > 5
    assert run(make_engine(folder), prompts) == hf_greedy(folder, prompts, MAX_NEW)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    folder = build_tiny_model(tmp_path, "llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    prompts = random_prompts(8, 256, seed=2, low=40, high=120)
    assert run(make_engine(folder), prompts) == hf_greedy(folder, prompts, MAX_NEW)


def test_chunked_prefill_matches(llama_case):
    folder, prompts, expected = llama_case
    engine = make_engine(folder, max_num_batched_tokens=16)
    assert max(map(len, prompts)) > 16
    assert run(engine, prompts) == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches(llama_case, mode):
    folder, prompts, expected = llama_case
    # 2 layers * 2 (K, V) * 16 tokens * 2 kv heads * 16 dims * 4 bytes = 8 KiB a block: 24 blocks.
    engine = make_engine(folder, kv_cache_memory=24 * 8192, preemption_mode=mode, swap_space=64 * 8192)
    assert run(engine, prompts) == expected
    assert engine.stats()["num_preemptions"] > 0
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_total_blocks


def test_preemption_with_chunked_prefill_and_no_prefix_cache(llama_case):
    folder, prompts, expected = llama_case
    engine = make_engine(folder, kv_cache_memory=24 * 8192, max_num_batched_tokens=24,
                         enable_prefix_caching=False)
    assert run(engine, prompts) == expected
    assert engine.stats()["num_preemptions"] > 0


def test_prefix_cache_hits_give_same_tokens(tiny_llama):
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 256, 70).tolist()
    prompts = [prefix + rng.integers(3, 256, 5).tolist() for _ in range(3)]
    expected = hf_greedy(tiny_llama, prompts, MAX_NEW)
    engine = make_engine(tiny_llama)
    assert run(engine, prompts[:1]) == expected[:1]
    hits_before = engine.stats()["prefix_cache_hits"]
    assert run(engine, prompts) == expected
    assert engine.stats()["prefix_cache_hits"] - hits_before >= 3 * 64  # 4 full blocks of the prefix each


def test_no_chunked_prefill(llama_case):
    folder, prompts, expected = llama_case
    engine = make_engine(folder, enable_chunked_prefill=False, max_num_batched_tokens=128)
    assert run(engine, prompts) == expected


def test_small_seq_budget_and_block_size(llama_case):
    folder, prompts, expected = llama_case
    engine = make_engine(folder, max_num_seqs=3, block_size=4)
    assert run(engine, prompts) == expected


@pytest.mark.slow
def test_default_model_chat_matches_transformers(default_model_path, default_model_hf):
    import copy

    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path)
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "Explain what a KV cache is in one paragraph.", "List three prime numbers."]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])
               for q in questions]
    engine = make_engine(default_model_path, tokenizer=tokenizer)
    ours = run(engine, prompts, max_tokens=32)
    model = default_model_hf
    config = copy.deepcopy(model.generation_config)  # the shared model's own stays as it is
    config.eos_token_id = None
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, max_new_tokens=32,
                             do_sample=False, eos_token_id=None, pad_token_id=2)[0, len(prompt):].tolist()
        assert got == ref
    assert "Paris" in tokenizer.decode(ours[0])


def test_head_dim_without_compiled_kernel_matches(tmp_path):
    # head_dim 24 is not among the decode kernel's compiled sizes: the torch path takes over.
    folder = build_tiny_model(tmp_path, "llama", hidden_size=72, num_attention_heads=3, num_key_value_heads=1)
    prompts = random_prompts(6, 256, seed=4)
    assert run(make_engine(folder), prompts) == hf_greedy(folder, prompts, MAX_NEW)

"""Tensor parallelism over torch.distributed (gloo, two processes): the same greedy tokens as one
rank, each rank holding about half the weights; in-process engines (the services:
tests/stack/test_tensor_parallel_stack.py)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.common.sampling_params import SamplingParams
from tiny_models import build_tiny_model, hf_greedy, make_engine

# The engines here take device auto: on a machine with one GPU, rank 1 has no GPU of its own (the
# rank -> device rule itself is tested without one: tests/test_device_memory.py).
pytestmark = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                reason="tensor parallelism on CUDA needs two GPUs")

PROMPTS = [[1, 5, 9, 33], [3] * 27, list(range(3, 50)), [7, 8] * 11 + [9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def run(model, tensor_parallel_size, params=GREEDY, **overrides):
    with make_engine(model, tensor_parallel_size=tensor_parallel_size, **overrides) as engine:
        results = engine.generate(PROMPTS, params)
        return [[s.token_ids for s in samples] for samples in results], engine.runner.weight_bytes(), engine.stats()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tp-llama"), "llama")


@pytest.fixture(scope="module")
def llama_one_kv_head(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tp-llama-1kv"), "llama", num_key_value_heads=1,
                            vocab_size=255)  # a vocabulary that does not split evenly


def test_two_ranks_equal_one_and_hold_half_the_weights(llama):
    one, bytes_one, _ = run(llama, 1)
    two, bytes_two, _ = run(llama, 2)
    assert two == one
    assert [s[0] for s in one] == hf_greedy(llama, PROMPTS, GREEDY.max_tokens)
    assert 0.45 < bytes_two / bytes_one < 0.55


def test_two_ranks_with_chunked_prefill_and_preemption(llama):
    # 20 blocks of 4 tokens on either rank count (a rank's block holds half the KV heads at TP=2).
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # K/V x layers x tokens x KV heads x head dim x float32
    budgets = dict(max_num_batched_tokens=16, block_size=4)
    one, _, stats_one = run(llama, 1, kv_cache_memory=20 * block_bytes, **budgets)
    two, _, stats_two = run(llama, 2, kv_cache_memory=20 * block_bytes // 2, **budgets)
    assert stats_one["num_blocks"] == stats_two["num_blocks"] == 20
    assert stats_two["num_preemptions"] > 0
    assert two == one


def test_a_single_kv_head_is_replicated_on_both_ranks(llama_one_kv_head):
    one, _, _ = run(llama_one_kv_head, 1)
    two, _, _ = run(llama_one_kv_head, 2)
    assert two == one


def test_seeded_samples_agree_across_rank_counts(llama):
    # Rank 0 samples and broadcasts; forked samples (n=2) must reach the other rank too.
    params = SamplingParams(temperature=1.0, n=2, seed=11, max_tokens=8, ignore_eos=True)
    one, _, _ = run(llama, 1, params)
    two, _, _ = run(llama, 2, params)
    assert two == one


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_moe_models_on_two_ranks(arch, tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp(f"tp-{arch}"), arch)
    one, bytes_one, _ = run(model, 1)
    two, bytes_two, _ = run(model, 2)
    assert two == one
    # MLA's latent projections and all norms are replicated: a bit over half.
    assert 0.45 < bytes_two / bytes_one < (0.62 if arch == "deepseek_v3" else 0.55)


def test_heads_that_do_not_split_are_refused(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("tp-odd"), "llama", num_attention_heads=3,
                             num_key_value_heads=3, hidden_size=48)
    with pytest.raises(ValueError, match="3 attention heads do not split across --tensor-parallel-size 2"):
        make_engine(model, tensor_parallel_size=2)


def test_bench_tp_runs_both_rank_counts(llama, tmp_path):
    from pagedserve.cli import main
    out = tmp_path / "tp.json"
    assert main(["bench", "tp", "--model", str(llama), "--dtype", "float32", "--num-prompts", "3", "--repeats", "1",
                 "--kv-cache-memory", "32MiB", "--json", str(out)]) == 0
    import json
    result = json.loads(out.read_text())
    assert result["tensor_parallel_size"] == 2 and len(result["2_ranks_output_tok_s"]) == 1
    assert result["median_ratio"] > 0


def test_prompt_logprobs_on_two_ranks_equal_one(llama_one_kv_head):
    # The head's all-gather runs on every rank; rank 0 alone builds the result (vocab 255: uneven split).
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    out = []
    for ranks in (1, 2):
        with make_engine(llama_one_kv_head, tensor_parallel_size=ranks, max_num_batched_tokens=16) as engine:
            out.append([[(t.token_id, t.rank, [i for i, _ in t.top_logprobs]) for t in samples[0].prompt_logprobs]
                        + [[t.logprob for t in samples[0].prompt_logprobs]]
                        for samples in engine.generate(PROMPTS, params)])
    for prompt, one, two in zip(PROMPTS, *out):
        assert len(one) == len(prompt)  # an entry per prompt position after the first, then the logprobs
        assert one[:-1] == two[:-1]
        assert max(abs(a - b) for a, b in zip(one[-1], two[-1])) < 1e-4


def test_two_ranks_with_speculative_decoding(llama):
    """n-gram speculation at TP 2: rank 0 verifies, the others take the kept tokens (a number only
    rank 0 knows) from its broadcast; the tokens equal one rank's without speculation."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
            "disable_by_batch_size": 0}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    one, _, _ = run(llama, 1, params)
    two, _, stats = run(llama, 2, params, speculative_config=spec)
    assert two == one
    assert stats["spec_decode"]["num_accepted_tokens"] > 0


def test_two_ranks_with_a_draft_model(llama):
    """A draft model at TP 2: rank 0 runs it unsharded and broadcasts its proposals; the target as
    its own draft keeps them all, and the tokens equal one rank's without speculation."""
    spec = {"method": "draft_model", "model": str(llama), "num_speculative_tokens": 3, "disable_by_batch_size": 0}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    one, _, _ = run(llama, 1, params)
    two, _, stats = run(llama, 2, params, speculative_config=spec)
    assert two == one
    assert stats["spec_decode"]["num_draft_tokens"] > 0 and stats["spec_decode"]["acceptance_rate"] == 1.0


def test_two_ranks_overlap_their_steps(llama):
    """Async scheduling at TP 2 (asked for on the CPU; CUDA's default): rank 0 broadcasts its sampled ids
    on the device as a step begins, so every rank begins the next step before the one before is finished,
    its decode rows fed from there, and takes its tokens from the broadcast rows at finish (no collective
    there). Greedy rows, a seeded pair that forks and chunked prefills in one batch: the tokens equal one
    rank's run step by step (before, TP ran each step to its tokens: nothing was held)."""
    params = [GREEDY, SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=10, ignore_eos=True), GREEDY, GREEDY]
    want = []
    for ranks, overlap in ((1, False), (2, True)):
        with make_engine(llama, tensor_parallel_size=ranks, async_scheduling=overlap,
                         max_num_batched_tokens=16) as engine:
            assert engine.overlaps == overlap
            want.append([[s.token_ids for s in samples] for samples in engine.generate(PROMPTS, params)])
            held = engine.runner.held_rows
    assert want[1] == want[0]
    assert held > 0


def test_a_single_rank_engine_beside_a_two_rank_one(llama):
    """One process, a two-rank engine built first and a one-rank one after it: the second is built for one
    rank (it hung in the two-rank group's collectives), both answer, alternately, the same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with make_engine(llama, tensor_parallel_size=2) as two:
        first = two.generate([[5, 6, 7]], params)[0][0].token_ids
        with make_engine(llama) as one:
            assert one.runner.tensor_parallel_size == 1
            assert one.generate([[5, 6, 7]], params)[0][0].token_ids == first
            assert two.generate([[5, 6, 7]], params)[0][0].token_ids == first

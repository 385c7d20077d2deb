"""DeepSeek-V2/V3: greedy outputs equal transformers' token for token (batched, chunked, preempted,
prefix-cached; q_lora_rank None; yarn rope), the paged cache holds only the latent and the rope key,
and the MLA backends equal attention over the expanded keys and values."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # The Triton MLA kernel runs under the interpreter on the CPU; triton reads this when first imported
    # (transformers or another test module may import it before this file's tests run).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.attention import AttentionMetadata, PrefillSeq
from pagedserve.worker.kv_cache import bytes_per_block
from pagedserve.worker.mla_attention import TorchMLABackend, TritonMLABackend
from tiny_models import build_tiny_model, hf_greedy, make_engine

MAX_NEW = 16
LENGTHS = (3, 17, 60, 8, 33)
V3_LAYERS, LATENT, ROPE = 3, 32, 16  # tiny_models' DeepSeek: 3 layers, kv_lora_rank 32, qk_rope_head_dim 16


def prompts_of(lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in lengths]


def run(engine, prompts, max_tokens: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [samples[0].token_ids for samples in engine.generate(prompts, params)]


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v2"])
def case(request, tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    prompts = prompts_of(LENGTHS)
    return folder, prompts, hf_greedy(folder, prompts, MAX_NEW)


def test_batch_matches_transformers(case):
    folder, prompts, expected = case
    assert run(make_engine(folder), prompts) == expected


def test_chunked_prefill_matches(case):
    folder, prompts, expected = case
    assert run(make_engine(folder, max_num_batched_tokens=8, long_prefill_token_threshold=8), prompts) == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches(case, mode):
    folder, prompts, expected = case
    per_block = V3_LAYERS * 16 * (LATENT + ROPE) * 4
    # 12 blocks: the 5 requests (up to 76 tokens, 5 blocks) crowd the pool, yet each fits alone.
    engine = make_engine(folder, kv_cache_memory=12 * per_block, preemption_mode=mode, swap_space=32 * per_block)
    assert run(engine, prompts) == expected
    assert engine.stats()["num_preemptions"] > 0
    manager = engine.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_total_blocks


def test_prefix_cache_hits_give_same_tokens(case):
    folder = case[0]
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 256, 40).tolist()
    prompts = [prefix + rng.integers(3, 256, n).tolist() for n in (5, 9, 2)]
    expected = hf_greedy(folder, prompts, MAX_NEW)
    engine = make_engine(folder)
    assert run(engine, prompts[:1]) == expected[:1]
    hits_before = engine.stats()["prefix_cache_hits"]
    assert run(engine, prompts) == expected
    assert engine.stats()["prefix_cache_hits"] - hits_before >= 3 * 32  # the prefix's 2 full blocks each


def test_cache_holds_latent_and_rope_key_only(case):
    folder = case[0]
    engine = make_engine(folder, kv_cache_memory=10 * 2**20)
    cache = engine.runner.kv.device_cache
    block_size = engine.config.block_size
    per_block = V3_LAYERS * block_size * (LATENT + ROPE) * 4  # float32, no K/V planes, no heads
    assert cache.shape[:2] == (V3_LAYERS, 1)
    assert cache.shape[3:] == (block_size, 1, LATENT + ROPE)
    assert bytes_per_block(engine.model_config, block_size, torch.float32) == per_block
    assert cache.shape[2] == 10 * 2**20 // per_block


@pytest.mark.parametrize("arch, overrides", [
    ("deepseek_v3", dict(q_lora_rank=None)),
    ("deepseek_v3", dict(rope_interleave=False, n_group=2, topk_group=1, norm_topk_prob=False, n_shared_experts=2)),
    ("deepseek_v2", dict(q_lora_rank=None, topk_method="greedy", n_group=None, topk_group=None)),
])
def test_variants_match_transformers(tmp_path, arch, overrides):
    folder = build_tiny_model(tmp_path, arch, seed=1, **overrides)
    prompts = prompts_of((5, 41, 12), seed=1)
    assert run(make_engine(folder), prompts) == hf_greedy(folder, prompts, MAX_NEW)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_yarn_rope_scaling_matches_transformers(tmp_path, arch):
    # Positions past original_max_position_embeddings; mscale != mscale_all_dim scales cos/sin
    # (attention factor) and mscale_all_dim the softmax.
    folder = build_tiny_model(tmp_path, arch, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}, max_position_embeddings=128)
    prompts = prompts_of((40, 60, 7), seed=2)
    assert run(make_engine(folder), prompts) == hf_greedy(folder, prompts, MAX_NEW)


# ---- the MLA backends against expanded attention --------------------------------------------
HEADS, NOPE, V_DIM, BLOCK, NUM_BLOCKS = 3, 8, 12, 4, 40


def mla_step(seqs: list[tuple[int, int]], rank: int, rope: int, seed: int = 0):
    """One step over sequences (context_len, query_len), single-token ones (decodes) first, each on
    scattered blocks of a cache filled with noise. Returns the inputs, the metadata and, per
    sequence, its full latent and rope entries (context then new) for the naive reference."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(NUM_BLOCKS, BLOCK, 1, rank + rope, generator=gen)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    num_tokens = sum(q for _, q in seqs)
    q_nope = torch.randn(num_tokens, HEADS, NOPE, generator=gen)
    q_rope = torch.randn(num_tokens, HEADS, rope, generator=gen)
    latent_new = torch.randn(num_tokens, rank, generator=gen)
    rope_new = torch.randn(num_tokens, rope, generator=gen)
    slots, tables, prefills, entries, start = [], [], [], [], 0
    for context, q_len in seqs:
        total = context + q_len
        blocks = [free.pop() for _ in range(-(-total // BLOCK))]
        seq_slots = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(total)]
        old = cache.view(-1, rank + rope)[seq_slots[:context]]
        new = torch.cat((latent_new[start:start + q_len], rope_new[start:start + q_len]), dim=-1)
        entries.append(torch.cat((old, new)))
        slots += seq_slots[context:]
        if q_len == 1:
            tables.append(blocks)
        else:
            prefills.append(PrefillSeq(start, q_len, context, torch.tensor(blocks)))
        start += q_len
    num_decodes = len(tables)
    decode_tables = decode_lens = decode_mask = None
    if num_decodes:
        width = max(map(len, tables))
        decode_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        decode_lens = torch.tensor([c + 1 for c, _ in seqs[:num_decodes]])
        span = torch.arange(width * BLOCK)
        decode_mask = torch.zeros(num_decodes, 1, 1, width * BLOCK).masked_fill(
            (span[None, :] >= decode_lens[:, None]).view(num_decodes, 1, 1, -1), float("-inf"))
    meta = AttentionMetadata(torch.tensor(slots), num_decodes, decode_tables, decode_lens, decode_mask, prefills)
    return q_nope, q_rope, latent_new, rope_new, cache, meta, entries


def expanded_attention(q_nope, q_rope, w_uk, w_uv, seqs, entries, rank, scale):
    """Per head: keys [W_UK c_kv, k_pe], values W_UV c_kv, causal softmax attention."""
    outs, start = [], 0
    for (context, q_len), entry in zip(seqs, entries):
        c_kv, k_pe = entry[:, :rank], entry[:, rank:]
        keys = torch.cat((torch.einsum("hnl,kl->hkn", w_uk, c_kv), k_pe.expand(HEADS, -1, -1)), dim=-1)
        values = torch.einsum("hvl,kl->hkv", w_uv, c_kv)
        q = torch.cat((q_nope[start:start + q_len], q_rope[start:start + q_len]), dim=-1).transpose(0, 1)
        scores = torch.einsum("hqd,hkd->hqk", q, keys) * scale
        causal = torch.arange(context + q_len)[None, :] <= torch.arange(context, context + q_len)[:, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,hkv->qhv", probs, values))
        start += q_len
    return torch.cat(outs)


MLA_STEPS = [
    [(5, 1), (9, 1), (0, 1), (7, 5), (0, 6)],  # decodes (one the first token), a chunk, a fresh prompt
    [(0, 11)],
    [(13, 1), (3, 1)],
]


def to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    def move(t):
        return None if t is None else t.to(device)

    return AttentionMetadata(move(meta.slot_mapping), meta.num_decodes, move(meta.decode_block_tables),
                             move(meta.decode_seq_lens), move(meta.decode_mask),
                             [PrefillSeq(p.query_start, p.query_len, p.context_len, move(p.block_ids))
                              for p in meta.prefills])


def check_backend(backend, seqs, rank: int, rope: int, seed: int = 0, device: str = "cpu") -> None:
    q_nope, q_rope, latent_new, rope_new, cache, meta, entries = mla_step(seqs, rank, rope, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    w_uk = torch.randn(HEADS, NOPE, rank, generator=gen) / rank ** 0.5
    w_uv = torch.randn(HEADS, V_DIM, rank, generator=gen) / rank ** 0.5
    scale = 0.3
    q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
    on_device = [t.to(device) for t in (q_latent, q_rope, latent_new, rope_new, cache)]
    out = backend.forward(*on_device, to_device(meta, torch.device(device)), scale).cpu()
    assert out.shape == (q_nope.shape[0], HEADS, rank)
    got = torch.einsum("thl,hvl->thv", out, w_uv)
    want = expanded_attention(q_nope, q_rope, w_uk, w_uv, seqs, entries, rank, scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    new = torch.cat((latent_new, rope_new), dim=-1)
    torch.testing.assert_close(on_device[-1].cpu().view(-1, rank + rope)[meta.slot_mapping], new)


@pytest.mark.parametrize("seqs", MLA_STEPS)
def test_torch_mla_backend_equals_expanded_attention(seqs):
    check_backend(TorchMLABackend(), seqs, rank=24, rope=8)


@pytest.fixture(scope="module")
def triton_device() -> str:
    """CUDA when there is one; else the CPU, with the kernels under the Triton interpreter."""
    if torch.cuda.is_available():
        return "cuda"
    pytest.importorskip("triton")
    tmla = pytest.importorskip("pagedserve.kernels.triton.mla_attention")
    import triton.language as tl
    if not all(type(f).__name__ == "InterpretedFunction" for f in (tl.standard.zeros, tmla._mla_kernel)):
        pytest.skip("triton was imported without TRITON_INTERPRET=1")
    return "cpu"


@pytest.mark.parametrize("seqs", MLA_STEPS)
def test_triton_mla_backend_equals_expanded_attention(seqs, triton_device):
    check_backend(TritonMLABackend(), seqs, rank=24, rope=8, seed=1, device=triton_device)


def test_yarn_is_refused_for_llama():
    from pagedserve.common.model_config import ModelConfig
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn' for LlamaForCausalLM"):
        ModelConfig.from_hf_dict(hf)

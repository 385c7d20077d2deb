"""Mixtral and Qwen2-MoE: greedy outputs equal transformers' token for token (plain, chunked prefill,
preemption, prefix-cache hits, dense layers among the MoE ones); the grouped experts backend
equals the naive one; the loader names a missing expert; a MoE block costs one all_reduce;
`pagedserve bench moe` runs."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pagedserve.common.model_config import ModelConfig
from pagedserve.common.sampling_params import SamplingParams
from tiny_models import build_tiny_model, hf_greedy, make_engine

MAX_NEW = 16
# Fixed lengths 3..60 (up to 4 blocks of 16 with the new tokens, 19 blocks in all); ids from a fixed seed.
LENGTHS = [3, 9, 17, 28, 44, 60]
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers * (K, V) * block size * KV heads * head dim * float32


def make_prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in LENGTHS]


PROMPTS = make_prompts()


def run(engine, prompts=PROMPTS):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [samples[0].token_ids for samples in engine.generate(prompts, params)]


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def moe_case(request, tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return folder, hf_greedy(folder, PROMPTS, MAX_NEW)


def test_batch_matches_transformers(moe_case):
    from pagedserve.worker.moe import FusedMoE
    folder, expected = moe_case
    engine = make_engine(folder)
    assert run(engine) == expected
    experts = [m for m in engine.runner.model.modules() if isinstance(m, FusedMoE)]
    chosen = type(engine.runner.platform.moe_backend())  # what the engine's device's platform picks
    assert len(experts) == 2 and all(type(m.backend) is chosen for m in experts)


def test_chunked_prefill_matches(moe_case):
    folder, expected = moe_case
    engine = make_engine(folder, max_num_batched_tokens=16)
    assert run(engine) == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches(moe_case, mode):
    folder, expected = moe_case
    engine = make_engine(folder, kv_cache_memory=10 * BLOCK_BYTES, preemption_mode=mode,
                         swap_space=32 * BLOCK_BYTES)
    assert run(engine) == expected
    assert engine.stats()["num_preemptions"] > 0
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_preemption_with_chunked_prefill_matches(moe_case):
    folder, expected = moe_case
    engine = make_engine(folder, kv_cache_memory=10 * BLOCK_BYTES, max_num_batched_tokens=24,
                         enable_prefix_caching=False)
    assert run(engine) == expected
    assert engine.stats()["num_preemptions"] > 0


def test_prefix_cache_hits_give_same_tokens(moe_case):
    folder, expected = moe_case
    engine = make_engine(folder)
    assert run(engine) == expected
    hits = engine.stats()["prefix_cache_hits"]
    assert run(engine) == expected  # the prompts' full blocks now come from the cache
    # Full blocks before each prompt's last token: 17, 28 -> 1; 44 -> 2; 60 -> 3 (block size 16).
    assert engine.stats()["prefix_cache_hits"] - hits >= 7 * 16


@pytest.mark.parametrize("overrides", [dict(mlp_only_layers=[0], norm_topk_prob=True),
                                       dict(num_hidden_layers=3, decoder_sparse_step=2)],
                         ids=["mlp_only_layers", "decoder_sparse_step"])
def test_qwen2_moe_dense_layers_match(tmp_path, overrides):
    from pagedserve.worker.models.llama import LlamaMLP
    from pagedserve.worker.models.qwen2_moe import Qwen2MoeSparseMoE
    folder = build_tiny_model(tmp_path, "qwen2_moe", **overrides)
    engine = make_engine(folder)
    kinds = [type(layer.mlp) for layer in engine.runner.model.layers]
    assert kinds == ([LlamaMLP, Qwen2MoeSparseMoE] if "mlp_only_layers" in overrides
                     else [LlamaMLP, Qwen2MoeSparseMoE, LlamaMLP])
    prompts = PROMPTS[::2]
    assert run(engine, prompts) == hf_greedy(folder, prompts, MAX_NEW)


def test_bfloat16_runs(moe_case):
    folder, _ = moe_case
    outs = run(make_engine(folder, dtype="bfloat16"), PROMPTS[:3])
    assert [len(o) for o in outs] == [MAX_NEW] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_backend_equals_naive(dtype):
    from pagedserve.worker.moe import GroupedTorchMoE, NaiveTorchMoE, softmax_topk
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, top_k = 37, 48, 40, 6, 3
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    weights, ids = softmax_topk(torch.randn(tokens, experts, generator=gen), top_k, renormalize=False)
    ids[torch.rand(tokens, top_k, generator=gen) < 0.3] = -1  # experts held by another rank
    ids[0] = -1  # a token with no expert here at all
    ids[:, 0].masked_fill_(torch.arange(tokens) % 5 == 1, 4)  # expert 4 crowded; some experts maybe idle
    grouped = GroupedTorchMoE().forward(x, w13, w2, weights, ids)
    naive = NaiveTorchMoE().forward(x, w13, w2, weights, ids)
    assert grouped.dtype == naive.dtype == dtype and grouped.shape == x.shape
    assert torch.all(grouped[0] == 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped.float(), naive.float(), rtol=tol, atol=tol)
    # Only -1 ids: nothing to compute.
    assert torch.all(GroupedTorchMoE().forward(x, w13, w2, weights, torch.full_like(ids, -1)) == 0)


def new_model(folder):
    from pagedserve.worker.models import model_class
    from pagedserve.worker.platform import platform_for
    cfg = ModelConfig.from_folder(folder)
    return model_class(cfg.architecture)(cfg, platform_for("cpu").attention_backend(), 64)


def checkpoint(folder, drop=(), add=()):
    """The folder's tensors (lazily: the file is open only while iterating), less `drop`, plus `add`."""
    from pagedserve.worker.weights import iter_lazy_weights
    for name, weight in iter_lazy_weights(folder, torch.float32, progress=False):
        if name not in drop:
            yield name, weight
    yield from add


MISSING_EXPERT = {"MixtralForCausalLM": "model.layers.1.block_sparse_moe.experts.3.w3.weight",
                  "Qwen2MoeForCausalLM": "model.layers.0.mlp.experts.2.down_proj.weight"}


def test_loader_names_missing_expert(moe_case):
    folder, _ = moe_case
    missing = MISSING_EXPERT[ModelConfig.from_folder(folder).architecture]
    new_model(folder).load_weights(checkpoint(folder))  # the whole checkpoint loads
    with pytest.raises(ValueError, match=r"lacks 1 expert weight\(s\): " + re.escape(missing) + "$"):
        new_model(folder).load_weights(checkpoint(folder, drop={missing}))
    # An expert beyond num_experts, or a projection the model lacks: named as unexpected.
    extra = missing.replace("experts.", "experts.1", 1)  # experts.13 / experts.12
    with pytest.raises(ValueError, match="unexpected weight " + re.escape(repr(extra))):
        new_model(folder).load_weights(checkpoint(folder, add=[(extra, torch.zeros(1))]))
    # Dropping a non-expert tensor keeps the generic message.
    with pytest.raises(ValueError, match="lacks weights for 1 parameters"):
        new_model(folder).load_weights(checkpoint(folder, drop={"model.norm.weight"}))


@pytest.mark.parametrize("num_tokens", [3, 20])
def test_moe_block_costs_one_all_reduce(moe_case, monkeypatch, num_tokens):
    """Routed experts and the shared expert leave partial sums; the block reduces once."""
    import pagedserve.worker.models.qwen2_moe as qwen_mod
    import pagedserve.worker.moe as moe_mod
    import pagedserve.worker.parallel as parallel_mod
    import pagedserve.worker.process_group as process_group_mod
    folder, _ = moe_case
    cfg = ModelConfig.from_folder(folder)
    calls = []

    def counting(x):
        calls.append(tuple(x.shape))
        return x
    for mod in (qwen_mod, moe_mod, parallel_mod, process_group_mod):
        monkeypatch.setattr(mod, "all_reduce", counting)
    from pagedserve.worker.models import model_class
    from pagedserve.worker.platform import platform_for
    model = model_class(cfg.architecture)(cfg, platform_for("cpu").attention_backend(), 64)
    model.load_weights(checkpoint(folder))
    block = model.layers[0].mlp
    out = block(torch.randn(num_tokens, cfg.hidden_size))
    assert calls == [(num_tokens, cfg.hidden_size)] and out.shape == (num_tokens, cfg.hidden_size)


def test_bench_moe_tiny(tmp_path, capsys):
    from pagedserve.cli import build_parser
    out = tmp_path / "moe.json"
    args = build_parser().parse_args(["bench", "moe", "--hidden-size", "32", "--intermediate-size", "48",
                                      "--num-experts", "4", "--top-k", "2", "--tokens", "1,9",
                                      "--dtypes", "float32,bfloat16", "--rounds", "2", "--min-time", "0",
                                      "--threads", "1", "--json", str(out)])
    result = args.func(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [(c["dtype"], c["tokens"]) for c in result["cases"]] == [
        ("float32", 1), ("float32", 9), ("bfloat16", 1), ("bfloat16", 9)]
    for case in result["cases"]:
        assert case["grouped_ms"] > 0 and case["naive_ms"] > 0 and len(case["naive_ms_all"]) == 2
        assert case["max_abs_diff"] < (1e-5 if case["dtype"] == "float32" else 5e-2)
    assert "naive/grouped" in capsys.readouterr().out

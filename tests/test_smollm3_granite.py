"""SmolLM3 (NoPE layers) and IBM Granite 3 (embedding, residual, attention and logits multipliers) on tiny
random models built here: greedy tokens equal transformers' in float32, plain, with chunked prefill and
on two tensor-parallel ranks; SmolLM3's sliding-window variant is refused by name."""

from __future__ import annotations

import json

import pytest

from pagedserve.common.model_config import ModelConfig
from tiny_models import build_tiny_model, hf_greedy, make_engine
from test_qwen3_phi3 import LENGTHS, MAX_NEW, PROMPTS, run

CASES = {"smollm3": ("smollm3", {}), "smollm3_untied": ("smollm3", dict(tie_word_embeddings=False)),
         "granite": ("granite", {})}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)
    return request.param, folder, hf_greedy(folder, PROMPTS, MAX_NEW)


def test_batch_and_chunks_match_transformers(case):
    name, folder, expected = case
    for engine in (make_engine(folder), make_engine(folder, max_num_batched_tokens=16)):
        with engine:
            got = run(engine)
        for length, ours, theirs in zip(LENGTHS, got, expected):
            assert ours == theirs, f"{name}: prompt of {length} tokens"


def test_two_ranks_match_transformers(case):
    name, folder, expected = case
    if name != "granite" and name != "smollm3":
        pytest.skip("the untied head is the Llama skeleton's, tested on two ranks there")
    with make_engine(folder, tensor_parallel_size=2) as engine:
        assert run(engine) == expected


def test_the_layers_are_what_the_config_says(case):
    name, folder, _ = case
    with make_engine(folder) as engine:
        model = engine.runner.model
        if name.startswith("smollm3"):
            assert [layer.self_attn.use_rope for layer in model.layers] == [True, False, True, False]
        else:
            assert (model.embedding_multiplier, model.logits_scaling) == (12.0, 8.0)
            assert all(layer.self_attn.scale == 0.0625 and layer.residual_multiplier == 0.22 for layer in model.layers)


def test_smollm3_sliding_window_is_refused(tmp_path):
    folder = build_tiny_model(tmp_path, "smollm3")
    cfg = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="SmolLM3 with use_sliding_window"):
        ModelConfig.from_hf_dict({**cfg, "use_sliding_window": True, "sliding_window": 8})


def test_logprobs_equal_transformers(case):
    """The logits' scale (Granite's logits_scaling) shows in the logprobs, not in greedy tokens."""
    import torch
    import transformers

    from pagedserve.common.sampling_params import SamplingParams
    name, folder, expected = case
    prompt = PROMPTS[3]
    with make_engine(folder) as engine:
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2))[0][0]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1], dim=-1)
    for step, sample in enumerate(out.logprobs):
        assert sample.logprob == pytest.approx(ref[step, sample.token_id].item(), abs=1e-4), name
        assert [lp for _, lp in sample.top_logprobs] == pytest.approx(ref[step].topk(2).values.tolist(), abs=1e-4)

"""A tiny random Gemma 2 written as a GGUF the way llama.cpp writes one (norms stored as 1 + w, its
tensor names and soft-cap keys, no chat template): our config and weights equal transformers' GGUF
loader's, and greedy tokens equal transformers' on prompts past the window, whole and chunked."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.model_files.gguf_loader import gguf_to_hf_config, prepare_gguf_folder
from pagedserve.worker.gguf_weights import iter_gguf_weights
from test_gemma3_gguf import WINDOW, write_gemma_gguf
from tiny_models import make_engine

HEAD_DIM = 256  # llama.cpp scales queries by head_dim ** -0.5; transformers' GGUF config keeps 256


def write_tiny_gemma2_gguf(path) -> None:
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                                    max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=WINDOW,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    model = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name else 0.02 if "embed" in name else 0.2)
    write_gemma_gguf(path, "gemma2", model, {
        "block_count": 4, "context_length": 256, "embedding_length": 64, "feed_forward_length": 96,
        "head_count": 4, "head_count_kv": 2, "key_length": HEAD_DIM, "value_length": HEAD_DIM,
        "rope_freq_base": 10000.0, "sliding_window": WINDOW, "layer_norm_rms_eps": 1e-6,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma2-gguf")
    write_tiny_gemma2_gguf(folder / "tiny.gguf")
    return folder / "tiny.gguf"


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                                             dtype=torch.float32, attn_implementation="eager").eval()


def test_config_and_weights_equal_transformers(tiny_gguf, reference):
    cfg = gguf_to_hf_config(tiny_gguf)
    ref = reference.config
    assert cfg["architectures"] == ["Gemma2ForCausalLM"]
    assert cfg["layer_types"] == ref.layer_types and cfg["sliding_window"] == ref.sliding_window == WINDOW
    for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "head_dim"):
        assert cfg[name] == getattr(ref, name), name
    expected = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    got = dict(iter_gguf_weights(tiny_gguf, torch.float32))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_prepared_folder_serves_like_transformers(tiny_gguf, reference, tmp_path):
    folder = prepare_gguf_folder(tiny_gguf, tmp_path / "prepared")
    assert "<start_of_turn>" in (folder / "chat_template.jinja").read_text()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 13, 30)]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for overrides in ({}, {"max_num_batched_tokens": 16}):
        with make_engine(folder, **overrides) as engine:
            assert [s[0].token_ids for s in engine.generate(prompts, params)] == expected

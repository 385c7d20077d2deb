"""A tiny random Gemma 3 written as a GGUF the way llama.cpp writes one (norms stored as 1 + w, its
tensor names, no chat template): our weights equal transformers' GGUF loader's, the prepared folder
gets Gemma 3's chat template, and greedy tokens equal transformers' on prompts past the window."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.model_files.gguf_loader import gguf_to_hf_config, prepare_gguf_folder
from pagedserve.worker.gguf_weights import iter_gguf_weights
from test_gguf_loader import _tiny_vocab
from tiny_models import make_engine

WINDOW = 8
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def write_tiny_gemma3_gguf(path: Path) -> None:
    torch.manual_seed(0)
    # Six layers: llama.cpp's fixed pattern makes layer 5 global and 0..4 local.
    cfg = transformers.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=WINDOW,
                                        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name else 0.02 if "embed" in name else 0.2)
    write_gemma_gguf(path, "gemma3", model, {
        "block_count": 6, "context_length": 256, "embedding_length": 64, "feed_forward_length": 96,
        "head_count": 4, "head_count_kv": 2, "key_length": 16, "value_length": 16, "rope_freq_base": 1_000_000.0,
        "sliding_window": WINDOW, "layer_norm_rms_eps": 1e-6})


def write_gemma_gguf(path: Path, arch: str, model, settings: dict) -> None:
    """model as llama.cpp's convert_hf_to_gguf.py writes a Gemma: settings by GGUFWriter.add_<name>,
    the tiny vocabulary of test_gguf_loader, its tensor names, norms stored as 1 + w."""
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny {arch}")
    for name, value in settings.items():
        getattr(w, f"add_{name}")(value)
    tokens, types = _tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{LAYER_NAMES[module]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        if "norm" in name:
            t = t + 1  # llama.cpp's convert_hf_to_gguf.py stores Gemma norms as 1 + w
        w.add_tensor(gname, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-gguf")
    write_tiny_gemma3_gguf(folder / "tiny.gguf")
    return folder / "tiny.gguf"


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                                             dtype=torch.float32).eval()


def test_weights_and_config_equal_transformers(tiny_gguf, reference):
    cfg = gguf_to_hf_config(tiny_gguf)
    ref = reference.config
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["layer_types"] == ref.layer_types and cfg["sliding_window"] == ref.sliding_window == WINDOW
    assert cfg["rope_parameters"] == ref.rope_parameters
    assert cfg["query_pre_attn_scalar"] == ref.query_pre_attn_scalar
    expected = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    got = dict(iter_gguf_weights(tiny_gguf, torch.float32))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_prepared_folder_serves_like_transformers(tiny_gguf, reference, tmp_path):
    # (not resolve_model under a fresh PAGEDSERVE_DATA_DIR: the CPU kernels would compile again there)
    folder = prepare_gguf_folder(tiny_gguf, tmp_path / "prepared")
    template = (folder / "chat_template.jinja").read_text()
    assert "<start_of_turn>" in template and "first_user_prefix" in template
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 13, 30, 47)]
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
    assert json.loads((folder / "config.json").read_text())["sliding_window"] == WINDOW

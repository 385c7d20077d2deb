"""GGUF loading: config, weights (Q/K un-permuted, dequantized) and tokenizer, against transformers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from pagedserve.model_files.default_model import ensure_default_model, resolve_model
from pagedserve.common.model_config import ModelConfig
from pagedserve.model_files.gguf_loader import gguf_to_hf_config, prepare_gguf_folder
from pagedserve.worker.gguf_weights import iter_gguf_weights

SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # As llama.cpp's convert_hf_to_gguf.py writes Q/K: rotary halves interleaved per head.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tiny_vocab() -> tuple[list[str], list[int]]:
    """3 special tokens, byte-level BPE symbols for printable ASCII and the GPT-2 space/newline, one merge."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    symbols = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a", "ab"]  # Ġ (space), Ċ (newline)
    tokens = specials + symbols
    tokens += [f"<unused{i}>" for i in range(128 - len(tokens))]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    return tokens, [int(t) for t in types]


def write_tiny_gguf(path: Path, arch: str = "llama", tie: bool = True, seed: int = 0, **overrides) -> dict:
    """A tiny random HF model written as an F32 GGUF the way llama.cpp would; returns its state dict.
    overrides: the config's sizes (hidden_size=256 for the K-quants' blocks of 256)."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=tie)
    kw.update(overrides)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_theta=50000.0, **kw))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(rope_theta=50000.0, **kw))
    with torch.no_grad():  # non-trivial values everywhere, norms and biases included
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if tie:
        sd.pop("lm_head.weight")

    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny test model")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(kw["hidden_size"])
    w.add_feed_forward_length(kw["intermediate_size"])
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(kw["hidden_size"] // 4)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(128)
    tokens, types = _tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    for name, t in sd.items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{layer_names[module]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}[name]
        if arch == "llama" and "q_proj" in name:
            t = _llama_cpp_permute(t, 4)
        elif arch == "llama" and "k_proj" in name:
            t = _llama_cpp_permute(t, 2)
        w.add_tensor(gname, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", False)])
def test_tiny_gguf_round_trip(tmp_path, arch, tie):
    path = tmp_path / "tiny.gguf"
    sd = write_tiny_gguf(path, arch, tie)

    got = dict(iter_gguf_weights(path, torch.float32))
    assert got.keys() == sd.keys()
    for name, tensor in sd.items():
        assert torch.equal(got[name], tensor), name
    assert all(t.dtype == torch.bfloat16 for _, t in iter_gguf_weights(path, torch.bfloat16))

    cfg = gguf_to_hf_config(path)
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert {k: cfg[k] for k in SHAPE_FIELDS} == dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=2)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 50000.0
    # transformers reads the same GGUF to the same config, and our dict round-trips through its config class
    ref = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    # Qwen2Config has no head_dim attribute; it derives it
    ref_head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads
    for key in SHAPE_FIELDS:
        assert cfg[key] == (ref_head_dim if key == "head_dim" else getattr(ref, key)), key
    ours = transformers.AutoConfig.for_model(**cfg)
    assert ours.rope_parameters["rope_theta"] == 50000.0
    assert ModelConfig.from_hf_dict(cfg).attention_bias == (arch == "qwen2")


def test_prepare_and_resolve_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_DATA_DIR", str(tmp_path / "data"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)

    folder = resolve_model(str(path))
    assert folder.parent == tmp_path / "data" / "gguf" and folder.name.startswith("tiny-")
    assert ModelConfig.from_folder(folder).num_key_value_heads == 2
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    assert (folder / "model.gguf").stat().st_size == path.stat().st_size
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    vocab = _tiny_vocab()[0]
    assert tok.encode("<|im_start|>ab c") == [1, vocab.index("ab"), vocab.index("\u0120"), vocab.index("c")]

    mtime = (folder / "config.json").stat().st_mtime_ns
    assert resolve_model(str(path)) == folder  # cached: nothing rewritten
    assert (folder / "config.json").stat().st_mtime_ns == mtime
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left

    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("")
    with pytest.raises(FileExistsError):
        prepare_gguf_folder(path, tmp_path / "junk")
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path / "junk"))
    with pytest.raises(FileNotFoundError, match="model not found"):
        resolve_model(str(tmp_path / "nope"))
    assert resolve_model(str(folder)) == folder


def test_bad_gguf_files(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 3000, 40, 0):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=str(bad)):
            gguf_to_hf_config(bad)
        with pytest.raises(ValueError, match=str(bad)):
            iter_gguf_weights(bad, torch.float32)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a valid GGUF"):
        gguf_to_hf_config(junk)

    other = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(other, "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        iter_gguf_weights(other, torch.float32)


# ---- the real default model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_model():
    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def hf_reference(default_model, default_model_hf, tmp_path_factory):
    # transformers reads the GGUF from a folder of its own, so our config.json cannot leak into it
    ref_dir = tmp_path_factory.mktemp("hf_ref")
    (ref_dir / "model.gguf").symlink_to(default_model / "model.gguf")
    tok = transformers.AutoTokenizer.from_pretrained(ref_dir, gguf_file="model.gguf")
    return default_model_hf, tok


@pytest.mark.slow
def test_default_model_weights_match_transformers(default_model, hf_reference):
    model, _ = hf_reference
    ref = model.state_dict()
    start = time.perf_counter()
    got = dict(iter_gguf_weights(default_model / "model.gguf", torch.float32))
    print(f"iter_gguf_weights: {time.perf_counter() - start:.2f}s for {len(got)} tensors")
    assert got.keys() == ref.keys() - {"lm_head.weight"}  # tied embeddings
    for name, tensor in got.items():
        assert torch.equal(tensor, ref[name]), name


@pytest.mark.slow
def test_default_model_config_and_tokenizer(default_model, hf_reference):
    model, ref_tok = hf_reference
    cfg = gguf_to_hf_config(default_model / "model.gguf")
    assert cfg == json.loads((default_model / "config.json").read_text())
    for key in SHAPE_FIELDS:
        assert cfg[key] == getattr(model.config, key), key
    assert cfg["rms_norm_eps"] == pytest.approx(model.config.rms_norm_eps, rel=1e-6)
    assert cfg["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (9, 3, 49152)

    tok = transformers.AutoTokenizer.from_pretrained(default_model)
    for text in ["Hello, world!", "  leading spaces\nand\ttabs", "naïve café 東京 🤖",
                 "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x**2  # ok"]:
        assert tok.encode(text) == ref_tok.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")

"""A tiny HF model folder (tiny_models.build_tiny_model) written as an F32 GGUF the way llama.cpp's
convert_hf_to_gguf.py writes one: the keys its TextModel.set_gguf_parameters derives from
config.json, the architecture's own keys (given by the test, as its converter class adds them), the
tensors of model.safetensors renamed by the gguf package's own TensorNameMap (what the converter's
map_tensor_name uses) and not permuted (the converters of olmo2, command-r, cohere2 and starcoder2
do not permute q/k), and test_gguf_loader's tiny byte-level vocabulary padded to the model's size."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from test_gguf_loader import _tiny_vocab


def convert_to_gguf(folder: Path, path: Path, arch: str, **extra) -> None:
    """folder's model as llama.cpp's converter writes `arch`; extra: GGUFWriter.add_<name> values."""
    hp = json.loads((folder / "config.json").read_text())
    arch_id = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_freq_base((hp.get("rope_parameters") or {}).get("rope_theta", hp.get("rope_theta")))
    if "rms_norm_eps" in hp:
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if (eps := next((hp[k] for k in ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon") if k in hp), None)):
        w.add_layer_norm_eps(eps)
    if hp.get("head_dim"):
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, value in extra.items():
        getattr(w, f"add_{name}")(value)
    tokens, types = _tiny_vocab()
    pad = hp["vocab_size"] - len(tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens + [f"<extra{i}>" for i in range(pad)])
    w.add_token_types(types + [int(gguf.TokenType.NORMAL)] * pad)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(hp["bos_token_id"])
    w.add_eos_token_id(hp["eos_token_id"])
    w.add_add_bos_token(False)
    names = gguf.get_tensor_name_map(arch_id, hp["num_hidden_layers"])
    for name, tensor in load_file(folder / "model.safetensors").items():
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise ValueError(f"llama.cpp's {arch} has no tensor for {name}")
        w.add_tensor(gname, tensor.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

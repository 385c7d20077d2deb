"""Per-architecture parts of reading a llama.cpp GGUF as an HF model (used by gguf_loader): the
names of each architecture's tensors in HF terms, and the config each one leaves to convention
(what llama.cpp hard-codes or takes from keys of its own), as llama.cpp's convert_hf_to_gguf.py
writes them and llama.cpp reads them back.

A hook gets the parsed file `g` (its `fields` and `tensors`), the config dict built from the keys
all architectures share, and `key(name, default)` for the `<arch>.<name>` keys; it updates the dict.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_NO_NORMS = {k: v for k, v in _LAYER_NAMES.items() if "norm" not in k}
# Gemma 3 norms by llama.cpp's names: ffn_norm is the pre-feedforward norm there, and llama.cpp
# stores every norm weight as (1 + w), which worker/gguf_weights.py turns back into HF's w.
_GEMMA3_NAMES = {**_LAYER_NAMES, **_QK_NORMS,
                 "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# OLMo 2: no norm before the sublayers, one after each (llama.cpp's post_attention_norm, post_ffw_norm).
_OLMO2_NAMES = {**_NO_NORMS, **_QK_NORMS,
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# Command-R: one norm a layer (attention and MLP in parallel on its output); per-head q/k norms.
_COMMAND_R_NAMES = {**_NO_NORMS, **_QK_NORMS, "attn_norm.weight": "input_layernorm.weight"}
# StarCoder2: LayerNorms with biases, biases on every projection, a plain MLP (c_fc, c_proj).
_STARCODER2_NAMES = {**{k: v for k, v in _LAYER_NAMES.items() if "gate" not in k and "ffn" not in k},
                     "attn_norm.bias": "input_layernorm.bias", "ffn_norm.weight": "post_attention_layernorm.weight",
                     "ffn_norm.bias": "post_attention_layernorm.bias", "attn_output.bias": "self_attn.o_proj.bias",
                     "ffn_up.weight": "mlp.c_fc.weight", "ffn_up.bias": "mlp.c_fc.bias",
                     "ffn_down.weight": "mlp.c_proj.weight", "ffn_down.bias": "mlp.c_proj.bias"}
LAYER_NAMES = {"gemma2": _GEMMA3_NAMES, "gemma3": _GEMMA3_NAMES, "olmo2": _OLMO2_NAMES,
               "command-r": _COMMAND_R_NAMES, "cohere2": _COMMAND_R_NAMES, "starcoder2": _STARCODER2_NAMES}
DEFAULT_LAYER_NAMES = _LAYER_NAMES
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output_norm.bias": "model.norm.bias",
                "output.weight": "lm_head.weight"}

Key = Callable[..., Any]


def _gemma3_config(g, cfg: dict, key: Key) -> None:
    """What a Gemma 3 GGUF leaves to convention (llama.cpp hard-codes these; transformers takes
    Gemma3TextConfig's defaults): every 6th layer global, local rope base 10k, queries scaled by
    query_pre_attn_scalar = head_dim, GeGLU; chat turns end with <end_of_turn>."""
    window, layers = key("attention.sliding_window"), cfg["num_hidden_layers"]
    cfg.update({
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": window,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        "query_pre_attn_scalar": 256,  # transformers' default; 256 = head_dim for the sizes up to 12B
        "rope_local_base_freq": 10000.0,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": dict(cfg["rope_parameters"])},
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    })
    _end_of_turn(g, cfg)


def _end_of_turn(g, cfg: dict) -> None:
    """Gemma's chat turns end with <end_of_turn> (a stop id) where the file names no eot token."""
    tokens = g.fields.get("tokenizer.ggml.tokens") or []
    if "<end_of_turn>" in tokens and not g.fields.get("tokenizer.ggml.eot_token_id"):
        cfg["eot_token_id"] = tokens.index("<end_of_turn>")


def _gemma2_config(g, cfg: dict, key: Key) -> None:
    """What a Gemma 2 GGUF leaves to convention, as llama.cpp reads it: every second layer local from
    the first, GeGLU, the soft-caps (Gemma2Config's 50 and 30 when the file has none), queries
    scaled by head_dim ** -0.5, except the 27B (46 layers) by (hidden / heads) ** -0.5."""
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    cfg.update({
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": key("attention.sliding_window", 4096),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "query_pre_attn_scalar": hidden // heads if layers == 46 else cfg["head_dim"],
        "attn_logit_softcapping": key("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": key("final_logit_softcapping", 30.0),
    })
    _end_of_turn(g, cfg)


def _olmo2_config(g, cfg: dict, key: Key) -> None:
    """OLMo 2: the Llama keys; its q/k norms are tensors. llama.cpp's olmo2 also carries OLMo 3
    (a sliding window on three layers of four), which pagedserve does not run."""
    if key("attention.sliding_window") is not None:
        raise ValueError(f"{g.path}: an olmo2 GGUF with a sliding window (OLMo 3) is not supported")


def _command_r_config(g, cfg: dict, key: Key) -> None:
    """Command-R (CohereForCausalLM): LayerNorm (llama.cpp's attention.layer_norm_epsilon), the logit
    scale (a key llama.cpp requires), per-head q/k norms when the file has them, embeddings tied
    (llama.cpp's command-r has no output tensor). The q/k rows stay in HF's order: llama.cpp's
    converter does not permute them (its command-r rotary takes the interleaved pairs HF's does)."""
    if key("logit_scale") is None:
        raise ValueError(f"{g.path}: GGUF metadata lacks {g.fields['general.architecture']}.logit_scale")
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    if (rotary := key("rope.dimension_count")) not in (None, head_dim):
        raise ValueError(f"{g.path}: rotary on {rotary} of {head_dim} head dimensions is not supported")
    cfg.update({
        "head_dim": key("attention.key_length") or head_dim,
        "layer_norm_eps": key("attention.layer_norm_epsilon", 1e-5),
        "logit_scale": key("logit_scale"),
        "use_qk_norm": "blk.0.attn_q_norm.weight" in g.tensors,
    })


def _cohere2_config(g, cfg: dict, key: Key) -> None:
    """Command R7B (Cohere2ForCausalLM): Command-R's layer (without q/k norms), three local layers to
    one global from the first (llama.cpp hard-codes the pattern of 4), local layers windowed by
    attention.sliding_window (required, as llama.cpp requires it)."""
    _command_r_config(g, cfg, key)
    if (window := key("attention.sliding_window")) is None:
        raise ValueError(f"{g.path}: GGUF metadata lacks cohere2.attention.sliding_window")
    layers = cfg["num_hidden_layers"]
    cfg.update({
        "sliding_window": window,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)],
    })


def _starcoder2_config(g, cfg: dict, key: Key) -> None:
    """StarCoder2: LayerNorm (attention.layer_norm_epsilon), biases throughout (use_bias, read from
    the tensors), tanh GELU. llama.cpp's converter writes no sliding window and llama.cpp applies
    none: neither do we."""
    cfg.update({
        "hidden_act": "gelu_pytorch_tanh",
        "norm_epsilon": key("attention.layer_norm_epsilon", 1e-5),
        "use_bias": "blk.0.attn_q.bias" in g.tensors,
        "sliding_window": None,
    })


CONFIG_HOOKS = {"gemma2": _gemma2_config, "gemma3": _gemma3_config, "olmo2": _olmo2_config,
                "command-r": _command_r_config, "cohere2": _cohere2_config, "starcoder2": _starcoder2_config}

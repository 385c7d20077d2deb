"""Tiny random-weight HF models, built and saved by the tests themselves."""

from __future__ import annotations

from pathlib import Path

import torch


def build_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random model (config.json + model.safetensors) into folder and return it."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common.update(overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(tie_word_embeddings=False, **common)
        model = transformers.MistralForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; sharper weights make greedy choices well separated.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.15)
            elif "bias" in name:
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own generate, one prompt at a time (no padding): the reference."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # ignore_eos, without min_new_tokens' eos masking
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        outs.append(gen[0, len(prompt):].tolist())
    return outs

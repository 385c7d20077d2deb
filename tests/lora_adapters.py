"""Random PEFT LoRA adapters on the tiny models (tests/tiny_models.py), built with `peft` itself,
and transformers + PEFT's greedy tokens with the adapter merged (`merge_and_unload`): the
reference the LoRA tests compare pagedserve with."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(base: Path, folder: Path, seed: int, r: int = 8, alpha: float = 16.0,
                  targets: list[str] | None = None, rslora: bool = False, scale: float = 0.3) -> Path:
    """A PEFT adapter of `base` with random A and B (PEFT starts B at zero: no change), saved to
    folder (adapter_config.json + adapter_model.safetensors)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, use_rslora=rslora,
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def merged_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' generate on the base model with the adapter merged in (None: the base)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        outs.append(gen[0, len(prompt):].tolist())
    return outs

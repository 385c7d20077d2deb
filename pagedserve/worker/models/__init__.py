"""The model classes by HF architecture name (imported on first use)."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3", "Qwen3MoeForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3_vl", "Gemma3ForConditionalGeneration"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "CohereForCausalLM": ("cohere", "CohereForCausalLM"),
    "Cohere2ForCausalLM": ("cohere", "Cohere2ForCausalLM"),
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2ForCausalLM"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Idefics3ForConditionalGeneration": ("idefics3", "Idefics3ForConditionalGeneration"),
    "SmolVLMForConditionalGeneration": ("idefics3", "Idefics3ForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Mistral3ForConditionalGeneration": ("mistral3", "Mistral3ForConditionalGeneration"),
}


def model_class(architecture: str):
    try:
        module, name = _MODELS[architecture]
    except KeyError:
        raise ValueError(f"no model implementation for {architecture!r}; have {', '.join(_MODELS)}") from None
    return getattr(importlib.import_module(f"pagedserve.worker.models.{module}"), name)

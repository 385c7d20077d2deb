"""A tiny Qwen2-VL / Qwen2.5-VL model folder: config.json of Qwen2VLForConditionalGeneration or
Qwen2_5_VLForConditionalGeneration (hub layout: the text model's fields at the top level, M-RoPE
sections [2, 3, 3] over 16-dim heads; a ViT over 14x14 patches, 2x2 merged), Qwen2VLImageProcessor's
preprocessor_config.json (min_pixels 3136, max_pixels 28*28*64: at most 64 placeholders an image, so
the CPU tests stay small), the default model's tokenizer (SmolLM2's, ChatML already) with Qwen2-VL's
vision tokens added and Qwen2-VL-7B-Instruct's chat template. No weights: with_random_weights
(tests/tiny_llava.py) gives them."""

from __future__ import annotations

import json
from pathlib import Path

# Qwen/Qwen2-VL-7B-Instruct's template (Qwen2.5-VL's is the same)
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

PREPROCESSOR = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "Qwen2VLImageProcessor",
                "image_std": [0.26862954, 0.26130258, 0.27577711], "max_pixels": 28 * 28 * 64, "merge_size": 2,
                "min_pixels": 3136, "patch_size": 14, "processor_class": "Qwen2VLProcessor", "resample": 3,
                "rescale_factor": 0.00392156862745098, "temporal_patch_size": 2}
SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
ARCHITECTURES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
VISION = {
    "qwen2_vl": {"model_type": "qwen2_vl", "embed_dim": 32, "depth": 2, "num_heads": 4, "mlp_ratio": 2,
                 "hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "qwen2_5_vl": {"model_type": "qwen2_5_vl", "hidden_size": 32, "intermediate_size": 48, "depth": 4,
                   "fullatt_block_indexes": [1, 3], "num_heads": 4, "out_hidden_size": 64, "window_size": 56,
                   "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "hidden_act": "silu"},
}


def build_tiny_qwen2_vl(folder: Path, tokenizer_folder: Path, family: str = "qwen2_vl",
                        preprocessor: dict | None = None) -> Path:
    """Write the folder (tokenizer from tokenizer_folder, e.g. the default model's) and return it."""
    from pagedserve.model_files.tokenizer_files import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    tokenizer.save_pretrained(folder)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"), ("video_token_id", "<|video_pad|>"))}
    config = {"architectures": [ARCHITECTURES[family]], "model_type": family, **ids,
              "vocab_size": len(tokenizer), "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
              "max_position_embeddings": 4096, "rope_theta": 10000.0,
              "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
              "tie_word_embeddings": False, "vision_config": VISION[family]}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor or PREPROCESSOR, indent=1))
    return folder


def reference_processor(folder: Path, preprocessor: dict | None = None):
    """transformers' Qwen2VLProcessor (Qwen2_5_VLProcessor for a Qwen2.5-VL folder) on the folder, with
    the PIL image processor and no video processor (its class check needs torchvision, not installed)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from pagedserve.model_files.tokenizer_files import load_tokenizer

    family = json.loads((folder / "config.json").read_text())["model_type"]
    base = Qwen2_5_VLProcessor if family == "qwen2_5_vl" else Qwen2VLProcessor

    class ImagesOnly(base):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    skip = ("image_processor_type", "processor_class")
    pre = {k: v for k, v in (preprocessor or PREPROCESSOR).items() if k not in skip}
    tokenizer = load_tokenizer(folder)
    return ImagesOnly(Qwen2VLImageProcessorPil(**pre), tokenizer, None, chat_template=QWEN2_VL_TEMPLATE)

"""A tiny llava-1.5-style model folder for the front end's tests: config.json of
LlavaForConditionalGeneration, CLIP's preprocessor_config.json, LlavaProcessor's
processor_config.json, the default model's tokenizer with an added <image> token and llava-hf's
chat template (images first, then text; content always a list). No weights: the front end never
loads them."""

from __future__ import annotations

import json
from pathlib import Path

# llava-hf/llava-1.5-7b-hf's template
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")

PREPROCESSOR = {"crop_size": {"height": 30, "width": 30}, "do_center_crop": True, "do_convert_rgb": True,
                "do_normalize": True, "do_rescale": True, "do_resize": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "CLIPImageProcessor",
                "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "rescale_factor": 0.00392156862745098,
                "size": {"shortest_edge": 32}}
PROCESSOR = {"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 10,
             "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default"}


def build_tiny_llava(folder: Path, tokenizer_folder: Path) -> Path:
    """Write the folder (tokenizer from tokenizer_folder, e.g. the default model's) and return it.
    Its images take (30 // 10) ** 2 + 1 - 1 = 9 tokens each."""
    from pagedserve.model_files.tokenizer_files import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = LLAVA_TEMPLATE
    tokenizer.save_pretrained(folder)
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "image_token_index": image_token, "vision_feature_select_strategy": "default",
              "vision_feature_layer": -2, "projector_hidden_act": "gelu",
              "text_config": {"model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 64,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128},
              "vision_config": {"model_type": "clip_vision_model", "image_size": 30, "patch_size": 10,
                                "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "intermediate_size": 64, "projection_dim": 32}}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    (folder / "processor_config.json").write_text(json.dumps(PROCESSOR, indent=1))
    return folder

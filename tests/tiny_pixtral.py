"""A tiny Mistral3 / Pixtral-LLaVA model folder for the front end's tests: config.json of
Mistral3ForConditionalGeneration (a Pixtral tower of patch 14, spatial_merge_size 2) or
LlavaForConditionalGeneration over a Pixtral tower (patch 16, no merge), both image_size 112; a Mistral
text model of hidden 64; PixtralImageProcessor's preprocessor_config.json (longest_edge 112, so an image
spans at most 4 x 5 or 7 x 8 tokens and the CPU tests stay small) and PixtralProcessor's
processor_config.json; the default model's tokenizer with [IMG], [IMG_BREAK] and [IMG_END] added (their ids
named in config.json, as Mistral's own tokenizers' 10, 12, 13 need not be) and a Mistral-style chat template
whose image parts render as [IMG]. No weights: with_random_weights (tests/tiny_llava.py) gives them."""

from __future__ import annotations

import json
from pathlib import Path

# pixtral-12b's template, trimmed to what these tests use: [INST]...[/INST], image chunks as [IMG]
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for chunk in message['content'] %}{% if chunk['type'] == 'text' %}{{ chunk['text'] }}"
    "{% elif chunk['type'] == 'image' %}[IMG]{% endif %}{% endfor %}{% endif %}[/INST]"
    "{% elif message['role'] == 'system' %}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for chunk in message['content'] %}{{ chunk['text'] }}{% endfor %}{% endif %}\n\n"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
SPECIAL = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
ARCHITECTURES = {"mistral3": "Mistral3ForConditionalGeneration", "llava": "LlavaForConditionalGeneration"}
PATCH, MERGE = {"mistral3": 14, "llava": 16}, {"mistral3": 2, "llava": 1}


def preprocessor(family: str, **change) -> dict:
    p = PATCH[family]
    return {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
            "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "image_processor_type": "PixtralImageProcessor",
            "patch_size": {"height": p, "width": p}, "processor_class": "PixtralProcessor", "resample": 3,
            "rescale_factor": 1 / 255, "size": {"longest_edge": 112}, **change}


def build_tiny_pixtral(folder: Path, tokenizer_folder: Path, family: str = "mistral3") -> Path:
    """Write the folder (tokenizer from tokenizer_folder, e.g. the default model's) and return it."""
    from pagedserve.model_files.tokenizer_files import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    image, brk, end = (tokenizer.convert_tokens_to_ids(t) for t in SPECIAL)
    text = {"model_type": "mistral", "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "tie_word_embeddings": False}
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 112, "patch_size": PATCH[family], "hidden_act": "silu",
              "rope_theta": 10000.0}
    config = {"architectures": [ARCHITECTURES[family]], "model_type": family, "text_config": text,
              "vision_config": vision, "image_token_index": image, "image_break_token_id": brk,
              "image_end_token_id": end, "projector_hidden_act": "gelu", "tie_word_embeddings": False}
    if family == "mistral3":
        config.update(spatial_merge_size=2, multimodal_projector_bias=False, vision_feature_layer=-1)
    else:
        config.update(vision_feature_layer=-1, vision_feature_select_strategy="full")
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor(family), indent=1))
    (folder / "processor_config.json").write_text(json.dumps({
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]", "image_token": "[IMG]",
        "patch_size": PATCH[family], "processor_class": "PixtralProcessor", "spatial_merge_size": MERGE[family]}))
    return folder


def reference_processor(folder: Path, pre: dict | None = None):
    """transformers' PixtralProcessor on the folder, with the PIL image processor. (processing_pixtral imports
    get_resize_output_image_size from the torchvision image processor's module, and torchvision is not
    installed: that module's name is given the PIL one's module, which defines the same function.)"""
    import importlib.util
    import sys

    from transformers.models.pixtral import image_processing_pil_pixtral
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
    if importlib.util.find_spec("torchvision") is None:
        sys.modules.setdefault("transformers.models.pixtral.image_processing_pixtral", image_processing_pil_pixtral)
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    from pagedserve.model_files.tokenizer_files import load_tokenizer

    family = json.loads((folder / "config.json").read_text())["model_type"]
    skip = ("image_processor_type", "processor_class")
    pre = {k: v for k, v in (pre or preprocessor(family)).items() if k not in skip}
    return PixtralProcessor(PixtralImageProcessorPil(**pre), load_tokenizer(folder), patch_size=PATCH[family],
                            spatial_merge_size=MERGE[family], chat_template=TEMPLATE)

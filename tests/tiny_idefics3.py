"""A tiny Idefics3 (SmolVLM-style) model folder for the front end's tests: config.json of
Idefics3ForConditionalGeneration (a SigLIP tower over 32x32 tiles of 8x8 patches, scale_factor 2:
4 rows a tile), Idefics3ImageProcessor's preprocessor_config.json (longest edge 64, 32x32 tiles),
processor_config.json (image_seq_len 4), the default model's tokenizer (SmolLM2's, SmolVLM's own
text model) with Idefics3's added tokens and SmolVLM-256M-Instruct's chat template. No weights: the
front end never loads them."""

from __future__ import annotations

import json
from pathlib import Path

# HuggingFaceTB/SmolVLM-256M-Instruct's template
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")

PREPROCESSOR = {"do_convert_rgb": True, "do_image_splitting": True, "do_normalize": True, "do_pad": True,
                "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
                "image_processor_type": "Idefics3ImageProcessor", "image_std": [0.5, 0.5, 0.5],
                "max_image_size": {"longest_edge": 32}, "resample": 1, "rescale_factor": 0.00392156862745098,
                "size": {"longest_edge": 64}}
PROCESSOR = {"image_seq_len": 4, "processor_class": "Idefics3Processor"}
SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
           *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]


def build_tiny_idefics3(folder: Path, tokenizer_folder: Path, preprocessor: dict | None = None) -> Path:
    """Write the folder (tokenizer from tokenizer_folder, e.g. the default model's) and return it."""
    from pagedserve.model_files.tokenizer_files import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.chat_template = SMOLVLM_TEMPLATE
    tokenizer.save_pretrained(folder)
    config = {"architectures": ["Idefics3ForConditionalGeneration"], "model_type": "idefics3",
              "image_token_id": tokenizer.convert_tokens_to_ids("<image>"), "scale_factor": 2,
              "text_config": {"model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 64,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128},
              "vision_config": {"model_type": "idefics3_vision", "image_size": 32, "patch_size": 8,
                                "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "intermediate_size": 64}}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor or PREPROCESSOR, indent=1))
    (folder / "processor_config.json").write_text(json.dumps(PROCESSOR, indent=1))
    return folder


def reference_processor(folder: Path, preprocessor: dict | None = None):
    """transformers' Idefics3Processor on the folder, with the PIL image processor (no torchvision)."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from pagedserve.model_files.tokenizer_files import load_tokenizer

    pre = {k: v for k, v in (preprocessor or PREPROCESSOR).items() if k != "image_processor_type"}
    tokenizer = load_tokenizer(folder)
    return Idefics3Processor(Idefics3ImageProcessorPil(**pre), tokenizer, image_seq_len=PROCESSOR["image_seq_len"],
                             chat_template=SMOLVLM_TEMPLATE)

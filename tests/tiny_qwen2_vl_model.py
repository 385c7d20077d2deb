"""Tiny random-weight Qwen2-VL and Qwen2.5-VL models for the worker's tests (tests/test_qwen2_vl*.py; the front end's
folder, tokenizer and processor files: tiny_qwen2_vl.py) built with transformers, and
transformers' own greedy answer on them: `generate` over pixel_values and image_grid_thw from
Qwen2VLImageProcessorPil (do_resize False) on the same uint8 pixels, float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pagedserve.common.multimodal import image_input
from tiny_models import generate_greedy, sharpen

IMAGE_TOKEN, VISION_START, VIDEO_TOKEN = 255, 254, 253  # inside the tiny vocabulary
FACTOR = 28  # patch 14, merge 2
SECTION = [2, 3, 3]  # head_dim 16: 8 rotary frequencies, 2 temporal, 3 height, 3 width
FAMILIES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def build_tiny_qwen2_vl(folder: Path, family: str = "qwen2_vl", seed: int = 0) -> Path:
    """The tiny model of `family` with its preprocessor_config.json (a mean and std other than CLIP's, so that
    the worker must read them; min_pixels low enough for 56x56 images)."""
    import transformers

    torch.manual_seed(seed)
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "mrope_section": SECTION, "rope_theta": 1000000.0})
    if family == "qwen2_vl":
        vision = dict(embed_dim=32, depth=2, num_heads=4, mlp_ratio=2, hidden_size=64, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        vision = dict(hidden_size=32, intermediate_size=48, depth=4, fullatt_block_indexes=[1, 3], num_heads=4,
                      out_hidden_size=64, window_size=56, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2)
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    cfg = config_class(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                       vision_start_token_id=VISION_START, video_token_id=VIDEO_TOKEN, tie_word_embeddings=False)
    model = model_class(cfg)
    sharpen(model, norm_mean=1.0, norm_std=0.2)
    model.save_pretrained(folder, safe_serialization=True)
    transformers.Qwen2VLImageProcessorPil(image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3],
                                          min_pixels=28 * 28, max_pixels=224 * 224).save_pretrained(folder)
    return folder


def random_image(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(1000 + seed).integers(3, 250, n).tolist()


def prompt_of(*parts) -> tuple[list[int], list[np.ndarray], list]:
    """parts: token lists and images (uint8 [h, w, 3]), in order -> (prompt ids, the images, their ImageInputs):
    each image over (h / 28) * (w / 28) placeholders."""
    ids, pixels, images = [], [], []
    for part in parts:
        if isinstance(part, np.ndarray):
            h, w = part.shape[:2]
            length = (h // FACTOR) * (w // FACTOR)
            images.append(image_input(len(ids), length, h, w, part.tobytes()))
            pixels.append(part)
            ids += [IMAGE_TOKEN] * length
        else:
            ids += part
    return ids, pixels, images


class Reference:
    """transformers' model of the folder: greedy tokens and each one's logprob (generate's logits)."""

    def __init__(self, folder: Path, family: str = "qwen2_vl") -> None:
        import transformers
        self.model = getattr(transformers, FAMILIES[family]).from_pretrained(folder, dtype=torch.float32).eval()
        self.processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(folder)

    def inputs(self, ids: list[int], pixels: list[np.ndarray]) -> dict:
        input_ids = torch.tensor([ids])
        out = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                   mm_token_type_ids=(input_ids == IMAGE_TOKEN).int())
        if pixels:
            processed = self.processor(images=pixels, do_resize=False, return_tensors="pt")
            out.update(pixel_values=processed.pixel_values, image_grid_thw=processed.image_grid_thw)
        return out

    def greedy(self, ids: list[int], pixels: list[np.ndarray], steps: int) -> tuple[list[int], list[float]]:
        return generate_greedy(self.model, self.inputs(ids, pixels), steps)

    @torch.no_grad()
    def forwards(self, ids: list[int], pixels: list[np.ndarray], steps: int) -> tuple[list[int], list[float]]:
        """Greedy by full forwards (get_rope_index over the prompt and the tokens so far, every step): for a
        prompt that ends with an image, where generate's decode positions step each section on from the
        image's last placeholder instead (its _update_model_kwargs_for_generation), unlike its own forward
        and get_rope_index; real prompts end with text (<|vision_end|>, the assistant's turn)."""
        ids, tokens, logprobs = list(ids), [], []
        for _ in range(steps):
            lp = torch.log_softmax(self.model(**self.inputs(ids, pixels)).logits[0, -1].float(), dim=-1)
            tokens.append(int(lp.argmax()))
            logprobs.append(lp[tokens[-1]].item())
            ids.append(tokens[-1])
        return tokens, logprobs

    @torch.no_grad()
    def rope_index(self, ids: list[int], pixels: list[np.ndarray]) -> np.ndarray:
        """transformers' get_rope_index: [3, tokens]."""
        inputs = self.inputs(ids, pixels)
        positions, _ = self.model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                       inputs.get("image_grid_thw"))
        return positions[:, 0].numpy()

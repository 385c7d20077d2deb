"""Tiny random-weight Mistral3 and Pixtral-in-LLaVA models for the worker's tests (tests/test_pixtral.py) built
with transformers, and transformers' own greedy answer on them: `generate` over pixel_values and image_sizes
from PixtralImageProcessorPil (do_resize False) on the same uint8 pixels, float32.

Mistral3: a Pixtral tower of patch 14, spatial_merge_size 2 (an image's rows and columns are height / 28 and
width / 28); Pixtral-LLaVA: patch 16, no merge, vision_feature_layer [1, -1] (two hidden states concatenated).
Both: image_size 112, a Mistral text model of hidden 64, 2 layers, 4 heads, 2 KV heads, vocabulary 256 with
[IMG] 10, [IMG_BREAK] 12, [IMG_END] 13 (Mistral's ids)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pagedserve.common.multimodal import image_input
from pagedserve.common.pixtral_config import span_tokens
from tiny_models import generate_greedy, sharpen

IMAGE, BREAK, END = 10, 12, 13
FACTOR = {"mistral3": 28, "llava": 16}
MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, sliding_window=None, rope_theta=1e6, tie_word_embeddings=False)


def build_tiny_pixtral(folder: Path, family: str = "mistral3", seed: int = 0) -> Path:
    import transformers

    torch.manual_seed(seed)
    patch = 14 if family == "mistral3" else 16
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, image_size=112, patch_size=patch,
                                              hidden_act="silu", rope_parameters={"rope_type": "axial",
                                                                                  "rope_theta": 1000.0})
    text = transformers.MistralConfig(**TEXT)
    if family == "mistral3":
        cfg = transformers.Mistral3Config(vision_config=vision, text_config=text, image_token_index=IMAGE,
                                          spatial_merge_size=2, tie_word_embeddings=False)
        model = transformers.Mistral3ForConditionalGeneration(cfg)
    else:
        cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE,
                                       vision_feature_layer=[1, -1], vision_feature_select_strategy="full",
                                       projector_hidden_act="gelu", tie_word_embeddings=False)
        model = transformers.LlavaForConditionalGeneration(cfg)
    sharpen(model, norm_mean=1.0, norm_std=0.2)
    model.save_pretrained(folder, safe_serialization=True)
    factor = FACTOR[family]
    transformers.PixtralImageProcessorPil(image_mean=MEAN, image_std=STD, size={"longest_edge": 112},
                                          patch_size={"height": factor, "width": factor}).save_pretrained(folder)
    return folder


def random_image(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def text(seed: int, n: int) -> list[int]:
    tokens = np.random.default_rng(1000 + seed).integers(3, 250, n)
    return [int(t) if t not in (IMAGE, BREAK, END) else 20 for t in tokens]


def prompt_of(family: str, *parts) -> tuple[list[int], list[np.ndarray], list]:
    """parts: token lists and images (uint8 [h, w, 3]) -> (prompt ids, the images, their ImageInputs): each
    image over its span of rows * (cols + 1) tokens."""
    ids, pixels, images = [], [], []
    for part in parts:
        if isinstance(part, np.ndarray):
            h, w = part.shape[:2]
            span = span_tokens(h // FACTOR[family], w // FACTOR[family], IMAGE, BREAK, END)
            images.append(image_input(len(ids), len(span), h, w, part.tobytes()))
            pixels.append(part)
            ids += span
        else:
            ids += [int(t) for t in part]
    return ids, pixels, images


class Reference:
    """transformers' model of the folder: greedy tokens and each one's logprob (generate's logits)."""

    def __init__(self, folder: Path, family: str = "mistral3") -> None:
        import transformers
        name = "Mistral3ForConditionalGeneration" if family == "mistral3" else "LlavaForConditionalGeneration"
        self.model = getattr(transformers, name).from_pretrained(folder, dtype=torch.float32).eval()
        self.processor = transformers.PixtralImageProcessorPil.from_pretrained(folder)

    def inputs(self, ids: list[int], pixels: list[np.ndarray]) -> dict:
        input_ids = torch.tensor([ids])
        out = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        if pixels:
            processed = self.processor(images=pixels, do_resize=False, return_tensors="pt")
            out.update(pixel_values=processed.pixel_values, image_sizes=processed.image_sizes)
        return out

    def greedy(self, ids: list[int], pixels: list[np.ndarray], steps: int) -> tuple[list[int], list[float]]:
        return generate_greedy(self.model, self.inputs(ids, pixels), steps)

    @torch.no_grad()
    def margins(self, ids: list[int], pixels: list[np.ndarray], steps: int) -> list[float]:
        """Each greedy step's gap between the best and the second logit (how far from a tie)."""
        gen = self.model.generate(**self.inputs(ids, pixels), max_new_tokens=steps, do_sample=False,
                                  min_new_tokens=steps, eos_token_id=None, pad_token_id=0, output_logits=True,
                                  return_dict_in_generate=True)
        return [float(top[0] - top[1]) for top in (step[0].topk(2).values for step in gen.logits)]

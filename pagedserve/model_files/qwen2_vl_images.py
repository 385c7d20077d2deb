"""Qwen2-VL and Qwen2.5-VL's image front end, without torch: an RGB image -> the image at the
dynamic resolution its processor picks (one ImageInput, sides multiples of patch_size * merge_size),
and a prompt's `<|image_pad|>` tokens -> one placeholder per merged patch of that image.

What transformers' Qwen2VLImageProcessor (Qwen2.5-VL uses the same one; the PIL backend's
Qwen2VLImageProcessorPil) does before rescale, normalize and patchify, from preprocessor_config.json:
convert to RGB (transparency composited onto white: image_processing._rgb), then with do_resize
smart_resize's height x width (both multiples of factor = patch_size * merge_size, rounded to the
nearest multiple, scaled down past max_pixels or up below min_pixels, aspect ratio at most 200) and a
PIL resize there with `resample` (BICUBIC unless the file names another). min_pixels / max_pixels are
the hub files' keys or transformers 5's size {"shortest_edge", "longest_edge"}, read as the worker reads
them (vision_config.image_normalization); patch_size, merge_size and temporal_patch_size must be the
vision tower's (config.json), or the folder is refused when it is read.

Qwen2VLProcessor's prompt: each `<|image_pad|>` (the chat template writes
`<|vision_start|><|image_pad|><|vision_end|>` for an image part) becomes grid_t * grid_h * grid_w /
merge_size^2 copies of itself: (height / factor) * (width / factor) for an image (grid_t is 1). The
copies are one token id, so the expansion is done on token ids; the tokenizer is checked once to make
`<|image_pad|>` and `<|vision_start|>` the config's ids.

What the worker gets: per image one ImageInput of height x width RGB uint8 over its placeholders; it
rescales, normalizes, patchifies (temporal_patch_size copies of the frame) and places the rows by
M-RoPE from the ImageInput's offset and grid (vision_config.image_grid). Whatever smart_resize makes
of an image the model takes (vision_config.dynamic_size_problem: one rule with the worker's check, which
allows smart_resize's own excess past max_pixels for an extreme aspect ratio).

Pure functions and a frozen config: safe on any thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from pagedserve.common.multimodal import ImageInput, expand_images
from pagedserve.common.vision_config import dynamic_size_problem, image_normalization, qwen2_vl_parts

IMAGE_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
BICUBIC = 3  # PIL's Image.Resampling.BICUBIC, the image processor's default
MAX_ASPECT = 200  # smart_resize refuses a longer side over 200 times the shorter


@dataclass(frozen=True)
class Qwen2VLConfig:
    """How one Qwen2-VL / Qwen2.5-VL model's images are resized and expanded in the prompt."""
    image_token_id: int
    vision_start_token_id: int
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    resample: int = BICUBIC
    do_resize: bool = True
    do_convert_rgb: bool = True

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """transformers' smart_resize (qwen2_vl): (height, width), both multiples of factor, near the
    image's aspect ratio, pixels brought within [min_pixels, max_pixels] where the shape allows."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"the image is {height}x{width}: its aspect ratio must be smaller than {MAX_ASPECT}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_image(config: Qwen2VLConfig, image: Image.Image) -> tuple[int, int, bytes]:
    """(height, width, RGB uint8 bytes row-major) of an RGB PIL image (decoded and converted by the
    caller) at the size the processor gives it. ValueError when the model cannot take it."""
    width, height = image.size
    if config.do_resize:
        height, width = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
        image = image.resize((width, height), resample=config.resample)
    elif height % config.factor or width % config.factor:
        raise ValueError(f"the image is {height}x{width}: this model does not resize images (do_resize is false) "
                         f"and takes sides that are multiples of {config.factor}")
    why = dynamic_size_problem(height, width, config.factor, config.min_pixels, config.max_pixels)
    if why:
        raise ValueError(why + (" once resized" if config.do_resize else " (do_resize is false)"))
    pixels = np.ascontiguousarray(np.asarray(image, dtype=np.uint8))
    return height, width, pixels.tobytes()


def placeholders(config: Qwen2VLConfig, height: int, width: int) -> int:
    """An image's placeholder tokens: one per merged patch, (height / factor) * (width / factor)."""
    return (height // config.factor) * (width // config.factor)


def expand(config: Qwen2VLConfig, prompt_ids: list[int],
           images: list[tuple[int, int, bytes]]) -> tuple[list[int], list[ImageInput]]:
    """(the prompt with each image token repeated once per merged patch of its image, one ImageInput
    per image over those copies), from a prompt with one image token per image (resize_image's images,
    in prompt order)."""
    return expand_images(prompt_ids, config.image_token_id, images,
                         lambda height, width: [config.image_token_id] * placeholders(config, height, width))


def _same(pre: dict, key: str, tower: int) -> None:
    if key in pre and int(pre[key]) != tower:
        raise ValueError(f"preprocessor_config.json's {key} {pre[key]} is not the vision tower's {tower}")


def qwen2_vl_config(pre: dict, config: dict, tokenizer) -> Qwen2VLConfig:
    """Qwen2VLImageProcessor's settings (pre: preprocessor_config.json's fields) for the model whose
    config.json is config, checked against its vision tower and its tokenizer."""
    vision = qwen2_vl_parts(config)[1]
    _same(pre, "patch_size", vision["patch_size"])
    _same(pre, "merge_size", vision["merge_size"])
    _same(pre, "temporal_patch_size", vision["temporal_patch_size"])
    size = pre.get("size")
    if size is not None:  # the processor's min_pixels / max_pixels stand in for size's keys
        keys = (set(size) if isinstance(size, dict) else set()) | \
            {k for k, given in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")) if given in pre}
        if not {"shortest_edge", "longest_edge"} <= keys:
            raise ValueError(f"preprocessor_config.json's size must be {{'shortest_edge', 'longest_edge'}} (pixels), "
                             f"got {size!r}")
    bounds = image_normalization(pre, vision)
    low, high = bounds["min_pixels"], bounds["max_pixels"]
    if not 0 < low <= high:
        raise ValueError(f"preprocessor_config.json's pixel range {low}..{high} is empty")
    image_token, start = int(vision["image_token_id"]), int(vision["vision_start_token_id"])
    for text, want, key in ((IMAGE_PAD, image_token, "image_token_id"),
                            (VISION_START, start, "vision_start_token_id")):
        got = list(tokenizer.encode(text, add_special_tokens=False))
        if got != [want]:
            raise ValueError(f"the tokenizer makes {text} {got}, not config.json's {key} {want}")
    return Qwen2VLConfig(image_token_id=image_token, vision_start_token_id=start, patch_size=vision["patch_size"],
                         merge_size=vision["merge_size"], temporal_patch_size=vision["temporal_patch_size"],
                         min_pixels=low, max_pixels=high, resample=int(pre.get("resample", BICUBIC)),
                         do_resize=bool(pre.get("do_resize", True)),
                         do_convert_rgb=bool(pre.get("do_convert_rgb", True)))

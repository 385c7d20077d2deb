"""Pixtral's and Mistral 3's image front end, without torch: an RGB image -> the image at the size
PixtralProcessor picks (one ImageInput, sides multiples of factor = patch_size * spatial_merge_size), and a
prompt's `[IMG]` tokens (one per image, as chat templates and vLLM's prompts write them) -> each image's
span: per row of (merged) patches `cols` `[IMG]` tokens then `[IMG_BREAK]`, the last row's break
`[IMG_END]`.

What transformers' PixtralImageProcessorPil does before rescale and normalize (PixtralProcessor passes it
patch_size * spatial_merge_size as its patch size), from preprocessor_config.json: convert to RGB
(transparency composited onto white: image_processing._rgb), then with do_resize get_resize_output_image_size's
height x width (scaled down, each side floored, when a side passes size's longest_edge, or its height /
width; then each side rounded up to a multiple of factor) and a PIL resize there with `resample` (BICUBIC
unless the file names another). Its padding for batching is the model's business, not the image's.
The worker's rules are vision_config's (common/pixtral_config.py: image_problem checks the span exactly);
a folder whose files disagree with the tower (processor_config.json's patch_size or spatial_merge_size, a
size that resizes past the tower's image_size, a tokenizer whose [IMG] / [IMG_BREAK] / [IMG_END] are not
config.json's ids) is refused when it is read.

Pure functions and a frozen config: safe on any thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from pagedserve.common.multimodal import ImageInput, expand_images
from pagedserve.common.pixtral_config import span_tokens
from pagedserve.common.vision_config import vision_parts

BICUBIC = 3  # PIL's Image.Resampling.BICUBIC, the image processor's default
TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")


@dataclass(frozen=True)
class PixtralConfig:
    """How one Pixtral-family model's images are resized and expanded in the prompt."""
    image_token_id: int
    image_break_token_id: int
    image_end_token_id: int
    factor: int  # patch_size * spatial_merge_size
    max_hw: tuple[int, int] = (1024, 1024)  # size's longest_edge twice, or its height and width
    max_side: int = 1024  # the tower's image_size rounded up to factor
    resample: int = BICUBIC
    do_resize: bool = True
    do_convert_rgb: bool = True


def output_size(height: int, width: int, config: PixtralConfig) -> tuple[int, int]:
    """transformers' pixtral get_resize_output_image_size: (height, width) after the resize."""
    max_h, max_w = config.max_hw
    ratio = max(height / max_h, width / max_w)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    f = config.factor
    return ((height - 1) // f + 1) * f, ((width - 1) // f + 1) * f


def resize_image(config: PixtralConfig, image: Image.Image) -> tuple[int, int, bytes]:
    """(height, width, RGB uint8 bytes row-major) of an RGB PIL image (decoded and converted by the caller)
    at the size the processor gives it. ValueError when the model cannot take it."""
    width, height = image.size
    if config.do_resize:
        new_h, new_w = output_size(height, width, config)
        if new_h <= 0 or new_w <= 0:
            raise ValueError(f"the image is {height}x{width}: its aspect ratio is too extreme to resize for this "
                             "model (a side would be empty)")
        height, width = new_h, new_w
        image = image.resize((width, height), resample=config.resample)
    f, top = config.factor, config.max_side
    if height % f or width % f or height > top or width > top:
        raise ValueError(f"the image is {height}x{width}: this model takes sides that are multiples of {f}, at most "
                         f"{top}" + ("" if config.do_resize else " (do_resize is false)"))
    pixels = np.ascontiguousarray(np.asarray(image, dtype=np.uint8))
    return height, width, pixels.tobytes()


def expand(config: PixtralConfig, prompt_ids: list[int],
           images: list[tuple[int, int, bytes]]) -> tuple[list[int], list[ImageInput]]:
    """(the prompt with each [IMG] token replaced by its image's span, one ImageInput per image over its whole
    span, breaks and end included), from a prompt with one [IMG] per image (resize_image's images, in order)."""
    return expand_images(prompt_ids, config.image_token_id, images, lambda height, width: span_tokens(
        height // config.factor, width // config.factor, config.image_token_id, config.image_break_token_id,
        config.image_end_token_id))


def _max_hw(size) -> tuple[int, int]:
    if isinstance(size, dict) and size.get("longest_edge"):
        return int(size["longest_edge"]), int(size["longest_edge"])
    if isinstance(size, dict) and size.get("height") and size.get("width"):
        return int(size["height"]), int(size["width"])
    raise ValueError(f"preprocessor_config.json's size must be {{'longest_edge'}} or {{'height', 'width'}}, "
                     f"got {size!r}")


def pixtral_config(pre: dict, proc: dict, config: dict, tokenizer) -> PixtralConfig:
    """PixtralImageProcessor's and PixtralProcessor's settings (pre: preprocessor_config.json's fields, proc:
    processor_config.json's) for the model whose config.json is config, checked against its vision tower
    and its tokenizer."""
    vision = vision_parts(config)[1]
    for key, tower in (("patch_size", vision["patch_size"]), ("spatial_merge_size", vision["merge_size"])):
        if key in proc and int(proc[key]) != tower:
            raise ValueError(f"processor_config.json's {key} {proc[key]} is not the vision tower's {tower}")
    factor = vision["patch_size"] * vision["merge_size"]
    max_hw = _max_hw(pre.get("size", {"longest_edge": vision["image_size"]}))
    do_resize = bool(pre.get("do_resize", True))
    reach = -(-max(max_hw) // factor) * factor
    if do_resize and reach > vision["max_side"]:
        raise ValueError(f"preprocessor_config.json resizes images to sides of up to {reach}: the vision tower takes "
                         f"at most {vision['max_side']} (image_size {vision['image_size']})")
    ids = (vision["image_token_id"], vision["image_break_token_id"], vision["image_end_token_id"])
    names = (proc.get("image_token", TOKENS[0]), proc.get("image_break_token", TOKENS[1]),
             proc.get("image_end_token", TOKENS[2]))
    for text, want in zip(names, ids):
        got = list(tokenizer.encode(text, add_special_tokens=False))
        if got != [want]:
            raise ValueError(f"the tokenizer makes {text} {got}, not the model's id {want}")
    return PixtralConfig(image_token_id=ids[0], image_break_token_id=ids[1], image_end_token_id=ids[2],
                         factor=factor, max_hw=max_hw, max_side=vision["max_side"],
                         resample=int(pre.get("resample", BICUBIC)), do_resize=do_resize,
                         do_convert_rgb=bool(pre.get("do_convert_rgb", True)))

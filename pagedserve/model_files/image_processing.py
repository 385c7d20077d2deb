"""A vision-language model's image front end, without torch: raw image bytes -> the resized,
center-cropped RGB an ImageInput (common/multimodal.py) carries, and a prompt's image tokens ->
the placeholders its images fill.

What transformers' CLIPImageProcessor does before rescale/normalize, from the model folder's
preprocessor_config.json (do_convert_rgb, do_resize + size {"shortest_edge"} or {"height",
"width"}, resample, do_center_crop + crop_size): decode (a GIF's or WebP's first frame), composite
transparency onto white and convert to RGB, resize with PIL (the short edge to N and the long one
to int(N * long / short), or to height x width), center-crop (zero-padding an image smaller than
the crop). The worker rescales and normalizes. The image token and the placeholders an image takes
are the worker's rule (common/vision_config.py: (image_size / patch_size)^2, plus the class row with
vision_feature_select_strategy "full"), which is transformers' LlavaProcessor's for a consistent
folder; a folder whose processor files disagree with it is refused when it is read.

Gemma 3 (gemma3_images.py): image_config gives a Gemma3ImageConfig (a resize to the tower's square, the
processor's "\n\n<start_of_image>...<end_of_image>\n\n" expansion).

Idefics3 / SmolVLM (idefics3_images.py): image_config gives an Idefics3Config, process_image the
image's tiles and global view (a TiledImage), expand_placeholders the processor's expansion of each
image token with one ImageInput per tile. Qwen2-VL / Qwen2.5-VL (qwen2_vl_images.py): a Qwen2VLConfig,
the image resized to its own dynamic resolution (smart_resize), each image token repeated once per
merged patch. Pixtral / Mistral 3 (pixtral_images.py): a PixtralConfig, the image resized so its longest
edge fits, sides rounded up to the patch grid, each image token replaced by its span of rows with break and end
tokens. The callers (the tokenizer service, prompt_images.py) are the same for every family.

Limits, checked before any pixel is decoded: MAX_IMAGE_BYTES of encoded image, MAX_IMAGE_PIXELS
(PIL's decompression-bomb guard is set to it, and a larger header is refused). Errors are
ValueError with a message a client can read. Pure functions and a frozen config: safe on any
thread (PIL releases nothing shared).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from pagedserve.common.multimodal import ImageInput, check_image_tokens, image_input
from pagedserve.common.pixtral_config import is_pixtral
from pagedserve.common.processor_kwargs import named, preprocessor
from pagedserve.common.vision_config import GEMMA3_ARCHITECTURES, IDEFICS3_ARCHITECTURES, QWEN2_VL_ARCHITECTURES, \
    idefics3_parts, llava_parts
from pagedserve.model_files import pixtral_images, qwen2_vl_images
from pagedserve.model_files.gemma3_images import Gemma3ImageConfig, gemma3_config, resize_image
from pagedserve.model_files.gemma3_images import expand as gemma3_expand
from pagedserve.model_files.idefics3_images import (LANCZOS, Idefics3Config, TiledImage, expand, max_grid,
                                                    read_pieces, tile_image)
from pagedserve.model_files.pixtral_images import PixtralConfig
from pagedserve.model_files.qwen2_vl_images import Qwen2VLConfig

MAX_IMAGE_BYTES = 20 << 20  # an encoded image (the gateway's fetch cap is the same)
MAX_IMAGE_PIXELS = 40_000_000  # width x height of a decoded image (about a 6300 x 6300 photo)
# PIL's own bomb guard (process-wide): an error past 2x this, a warning past 1x; open_image refuses past 1x
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS

# The architectures whose images the worker encodes; another model's image token is not taken: such a
# model serves text only.


@dataclass(frozen=True)
class ImageConfig:
    """How one model's images are prepared and how many prompt tokens each takes."""
    image_token_id: int
    tokens_per_image: int
    do_convert_rgb: bool = True
    do_resize: bool = True
    shortest_edge: int | None = 224  # resize the short edge to this (or to height x width below)
    resize_hw: tuple[int, int] | None = None
    resample: int = 3  # PIL's: 3 bicubic
    do_center_crop: bool = True
    crop_hw: tuple[int, int] = (224, 224)


# what image_config gives for a model that takes images: the callers pass it back, never look inside
AnyImageConfig = ImageConfig | Idefics3Config | Qwen2VLConfig | Gemma3ImageConfig | PixtralConfig


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except ValueError as exc:
        raise ValueError(f"{path.name} is not JSON: {exc}") from None


def _hw(size: dict | int, what: str) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    if isinstance(size, dict) and "height" in size and "width" in size:
        return int(size["height"]), int(size["width"])
    raise ValueError(f"preprocessor_config.json's {what} must be {{'height', 'width'}}, got {size!r}")


def image_config(folder: str | Path, tokenizer=None, mm_processor_kwargs: str | dict | None = None) -> \
        AnyImageConfig | None:
    """The image front end of the model in folder (ImageConfig for LLaVA, Idefics3Config for
    Idefics3 / SmolVLM, Qwen2VLConfig for Qwen2-VL / Qwen2.5-VL); None for a model that takes no
    images (another architecture). The image
    token and the placeholders per image (per tile) are the worker's own reading of config.json
    (common/vision_config.py); the processor files must agree with it (images or tiles of the tower's
    size, processor_config.json's image_seq_length / image_seq_len). Idefics3's expansion tokens are
    read from tokenizer (default: the folder's own), Qwen2-VL's image tokens checked against it. mm_processor_kwargs
    (--mm-processor-kwargs) is laid over preprocessor_config.json first, as the worker reads it
    (common/processor_kwargs.py); a refusal then names it."""
    folder = Path(folder)
    config = _read(folder / "config.json")
    pre = preprocessor(folder, config, mm_processor_kwargs)
    try:
        return _image_config(folder, config, pre, tokenizer)
    except ValueError as exc:
        raise named(exc, mm_processor_kwargs) from None


def _image_config(folder: Path, config: dict, pre: dict, tokenizer) -> AnyImageConfig | None:
    archs = config.get("architectures") or ()
    if is_pixtral(config):  # Mistral3, LLaVA over a Pixtral tower: pixtral_images.py
        return pixtral_images.pixtral_config(pre, _read(folder / "processor_config.json"), config,
                                             tokenizer if tokenizer is not None else _folder_tokenizer(folder))
    if set(archs) & set(QWEN2_VL_ARCHITECTURES):
        return qwen2_vl_images.qwen2_vl_config(pre, config,
                                               tokenizer if tokenizer is not None else _folder_tokenizer(folder))
    if set(archs) & set(IDEFICS3_ARCHITECTURES):
        return idefics3_config(folder, config, pre, tokenizer)
    if set(archs) & set(GEMMA3_ARCHITECTURES):  # Gemma 3 (gemma3_images.py): its expansion re-tokenizes
        if tokenizer is None:
            from pagedserve.model_files.tokenizer_files import load_tokenizer
            tokenizer = load_tokenizer(folder)
        return gemma3_config(config, pre, _read(folder / "processor_config.json"), tokenizer)
    if "LlavaForConditionalGeneration" not in archs:
        return None
    vision = llava_parts(config)[1]
    side = vision["image_size"]
    proc = _read(folder / "processor_config.json")
    unknown = sorted(k for k in ("do_pad", "image_grid_pinpoints") if pre.get(k))
    if unknown:
        raise ValueError(f"preprocessor_config.json: {unknown[0]} is not supported (CLIP-style processing only)")
    size = pre.get("size", {"shortest_edge": side})
    shortest, resize_hw = None, None
    if isinstance(size, dict) and "shortest_edge" in size:
        shortest = int(size["shortest_edge"])
    else:
        resize_hw = _hw(size, "size")
    crop_hw = _hw(pre.get("crop_size", {"height": side, "width": side}), "crop_size")
    do_crop = bool(pre.get("do_center_crop", True))
    out_hw = crop_hw if do_crop else resize_hw
    if out_hw != (side, side):
        made = "images of the input's own shape" if out_hw is None else f"{out_hw[0]}x{out_hw[1]} images"
        raise ValueError(f"preprocessor_config.json makes {made}: the vision tower takes {side}x{side}")
    tokens = vision["num_image_tokens"]
    if proc.get("image_seq_length") and int(proc["image_seq_length"]) != tokens:
        raise ValueError(f"processor_config.json's image_seq_length {proc['image_seq_length']} is not the "
                         f"{tokens} rows the vision tower makes of an image")
    return ImageConfig(image_token_id=int(vision["image_token_id"]), tokens_per_image=tokens,
                       do_convert_rgb=bool(pre.get("do_convert_rgb", True)), do_resize=bool(pre.get("do_resize", True)),
                       shortest_edge=shortest, resize_hw=resize_hw, resample=int(pre.get("resample", 3)),
                       do_center_crop=do_crop, crop_hw=crop_hw)


def idefics3_config(folder: Path, config: dict, pre: dict, tokenizer=None) -> Idefics3Config:
    """Idefics3ImageProcessor's settings (pre: preprocessor_config.json's, overrides laid over) and
    Idefics3Processor's expansion for the folder."""
    vision = idefics3_parts(config)[1]
    side, tokens = vision["image_size"], vision["num_image_tokens"]
    proc = _read(folder / "processor_config.json")
    max_size = pre.get("max_image_size", {"longest_edge": 364})
    if not isinstance(max_size, dict) or "longest_edge" not in max_size:
        raise ValueError(f"preprocessor_config.json's max_image_size must be {{'longest_edge'}}, got {max_size!r}")
    tile = int(max_size["longest_edge"])
    if tile != side:
        raise ValueError(f"preprocessor_config.json makes {tile}x{tile} tiles: the vision tower takes {side}x{side}")
    size = pre.get("size", {"longest_edge": 4 * 364})
    longest, resize_hw = None, None
    if isinstance(size, dict) and "longest_edge" in size:
        longest = int(size["longest_edge"])
    else:
        resize_hw = _hw(size, "size")
    seq_len = int(proc.get("image_seq_len", 169))  # Idefics3Processor's default
    if seq_len != tokens:
        raise ValueError(f"processor_config.json's image_seq_len {seq_len} is not the {tokens} rows the vision "
                         "tower makes of a tile")
    do_resize = bool(pre.get("do_resize", True))
    tokenizer = tokenizer if tokenizer is not None else _folder_tokenizer(folder)
    image_token = int(vision["image_token_id"])
    pieces = read_pieces(tokenizer, image_token, tokens, max_grid(tile, longest, resize_hw, do_resize))
    return Idefics3Config(image_token_id=image_token, tokens_per_image=tokens, tile=tile, longest_edge=longest,
                          resize_hw=resize_hw, resample=int(pre.get("resample", LANCZOS)),
                          do_convert_rgb=bool(pre.get("do_convert_rgb", True)), do_resize=do_resize,
                          do_image_splitting=bool(pre.get("do_image_splitting", True)), **pieces)


def _folder_tokenizer(folder: Path):
    from pagedserve.model_files.tokenizer_files import load_tokenizer
    return load_tokenizer(folder)


def open_image(data: bytes) -> Image.Image:
    """The image in data (PNG, JPEG, WebP, GIF, ...: what PIL reads), header read and checked
    against the limits, pixels not yet decoded. ValueError when it is none or too large."""
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image has {len(data)} bytes: at most {MAX_IMAGE_BYTES} are accepted")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise ValueError(f"the image has more than {MAX_IMAGE_PIXELS} pixels") from None
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ...
        raise ValueError(f"the data is not an image PIL can read ({type(exc).__name__})") from None
    width, height = image.size
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"the image is {width}x{height}: at most {MAX_IMAGE_PIXELS} pixels are accepted")
    return image


def _rgb(image: Image.Image, convert: bool) -> Image.Image:
    if not convert:
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def _center_crop(pixels: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    height, width = pixels.shape[:2]
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    if top >= 0 and left >= 0:
        return pixels[top:top + crop_h, left:left + crop_w]
    # smaller than the crop: zero-padded (centered, the extra row/column at the start), then cropped
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    pad_top, pad_left = -(-(new_h - height) // 2), -(-(new_w - width) // 2)
    padded = np.zeros((new_h, new_w, pixels.shape[2]), dtype=pixels.dtype)
    padded[pad_top:pad_top + height, pad_left:pad_left + width] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[top:top + crop_h, left:left + crop_w]


def process_image(config: AnyImageConfig, data: bytes | Image.Image) -> tuple[int, int, bytes] | TiledImage:
    """(height, width, RGB uint8 bytes row-major) of one image (encoded bytes or a PIL image) as
    the model's processor prepares it before rescale and normalize (a Qwen2-VL model's: at its own
    resized shape); an Idefics3 model's tiles and global view (idefics3_images.TiledImage)."""
    image = open_image(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        image.seek(0)  # an animation's first frame
    except (AttributeError, EOFError):
        pass
    try:
        image.load()
        image = _rgb(image, config.do_convert_rgb)
        if image.mode != "RGB":
            raise ValueError(f"the image is {image.mode}, not RGB (and do_convert_rgb is false)")
        if isinstance(config, Idefics3Config):
            return tile_image(config, image)
        if isinstance(config, Qwen2VLConfig):
            return qwen2_vl_images.resize_image(config, image)
        if isinstance(config, Gemma3ImageConfig):
            return resize_image(config, image)
        if isinstance(config, PixtralConfig):
            return pixtral_images.resize_image(config, image)
        if config.do_resize:
            width, height = image.size
            if config.resize_hw is not None:
                new_h, new_w = config.resize_hw
            else:
                short, long = (width, height) if width <= height else (height, width)
                new_short, new_long = config.shortest_edge, int(config.shortest_edge * long / short)
                new_h, new_w = (new_long, new_short) if width <= height else (new_short, new_long)
            image = image.resize((new_w, new_h), resample=config.resample)
        pixels = np.asarray(image, dtype=np.uint8)
    except ValueError:
        raise
    except Exception as exc:  # a truncated or corrupt file fails only when its pixels are decoded
        raise ValueError(f"the image could not be decoded ({type(exc).__name__}: {exc})") from None
    if config.do_center_crop:
        pixels = _center_crop(pixels, *config.crop_hw)
    pixels = np.ascontiguousarray(pixels)
    return pixels.shape[0], pixels.shape[1], pixels.tobytes()


def expand_placeholders(config: AnyImageConfig, prompt_ids: list[int],
                        images: list) -> tuple[list[int], list[ImageInput]]:
    """(the prompt with each image token repeated tokens_per_image times, the ImageInputs over them),
    from a prompt with one image token per image (as chat templates render them) and the
    processed images (process_image) in prompt order. ValueError when the counts differ. An
    Idefics3 model's: each image token becomes its processor's expansion, one ImageInput per tile
    and global view (idefics3_images.expand); a Qwen2-VL model's: one copy per merged patch of its
    image (qwen2_vl_images.expand)."""
    if isinstance(config, Idefics3Config):
        return expand(config, prompt_ids, images)
    if isinstance(config, Qwen2VLConfig):
        return qwen2_vl_images.expand(config, prompt_ids, images)
    if isinstance(config, Gemma3ImageConfig):
        return gemma3_expand(config, prompt_ids, images)
    if isinstance(config, PixtralConfig):
        return pixtral_images.expand(config, prompt_ids, images)
    check_image_tokens(prompt_ids, config.image_token_id, len(images))
    out: list[int] = []
    placed: list[ImageInput] = []
    for token in prompt_ids:
        if token == config.image_token_id:
            height, width, data = images[len(placed)]
            placed.append(image_input(len(out), config.tokens_per_image, height, width, data))
            out.extend([token] * config.tokens_per_image)
        else:
            out.append(token)
    return out, placed

"""Gemma 3's image front end, without torch: an RGB image -> the tower's square (one ImageInput), and a prompt's
`<start_of_image>` tokens -> Gemma3Processor's expansion around them.

Gemma3ImageProcessor (PIL backend) before rescale and normalize, from preprocessor_config.json: convert to RGB,
resize to size {"height", "width"} (the tower's image_size square: 896 on the hub) with `resample` (BILINEAR, 2,
unless the file names another), no crop; so the bytes an ImageInput carries are its resized image's. Pan and scan
(do_pan_and_scan: extra crops of a long image) is off in the hub's files and in vLLM's default: a folder that turns
it on is refused, rather than served with other images than transformers would give.

Gemma3Processor's prompt: the text's `<start_of_image>` (one per image, as the chat template renders image parts)
becomes "\\n\\n<start_of_image>" + mm_tokens_per_image x `<image_soft_token>` + "<end_of_image>\\n\\n", and the
whole text is tokenized. The three image tokens are added tokens, so the text between added tokens is tokenized
piece by piece; the "\\n\\n"s join the text pieces next to the image, whose tokens may then change (a tokenizer
may merge newlines with what is around them: "\\n" + "\\n\\n" is one token "\\n\\n\\n" in Gemma's). So the
expansion works on token ids, and re-tokenizes just those neighbouring pieces, decoded, with their "\\n\\n"
(Gemma3ImageConfig.tokenizer): ids a tokenizer made from text come out as the processor's. The image's
placeholders are the `<image_soft_token>`s: `tokens_per_image` of them from the ImageInput's offset.

A frozen config and pure functions (the tokenizer's encode and decode are read-only): safe on any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from pagedserve.common.multimodal import ImageInput, check_image_tokens, image_input
from pagedserve.common.vision_config import gemma3_parts

BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
BILINEAR = 2  # PIL's Image.Resampling.BILINEAR, Gemma3ImageProcessor's default


@dataclass(frozen=True)
class Gemma3ImageConfig:
    """How one Gemma 3 model's images are prepared and expanded in the prompt."""
    image_token_id: int  # the rendered prompt's image token: <start_of_image>, one per image
    soft_token_id: int  # <image_soft_token>: the placeholders
    eoi_token_id: int
    tokens_per_image: int
    size: tuple[int, int]  # (height, width): the tower's square
    resample: int = BILINEAR
    do_convert_rgb: bool = True
    do_resize: bool = True
    tokenizer: object = field(default=None, compare=False, repr=False)  # re-tokenizes the image's neighbours
    added: frozenset[int] = frozenset()  # the tokenizer's added tokens' ids: text pieces end at them


def gemma3_config(config: dict, pre: dict, proc: dict, tokenizer) -> Gemma3ImageConfig:
    """The front end of a Gemma3ForConditionalGeneration folder (config.json, preprocessor_config.json,
    processor_config.json read) with its tokenizer; ValueError where they disagree with the model."""
    vision = gemma3_parts(config)[1]
    side, tokens = vision["image_size"], vision["num_image_tokens"]
    if pre.get("do_pan_and_scan"):
        raise ValueError("preprocessor_config.json: do_pan_and_scan is not supported (vLLM's default is off too)")
    size = pre.get("size", {"height": side, "width": side})
    hw = (int(size["height"]), int(size["width"])) if isinstance(size, dict) and "height" in size else None
    if hw != (side, side):
        raise ValueError(f"preprocessor_config.json makes {size!r} images: the vision tower takes {side}x{side}")
    seq = proc.get("image_seq_length")
    if seq is not None and int(seq) != tokens:
        raise ValueError(f"processor_config.json's image_seq_length {seq} is not the model's "
                         f"mm_tokens_per_image {tokens}")
    ids = {}
    for text, want in ((BOI, vision["boi_token_id"]), (EOI, vision["eoi_token_id"]), (IMAGE, vision["image_token_id"])):
        got = list(tokenizer.encode(text, add_special_tokens=False))
        if got != [want]:
            raise ValueError(f"the tokenizer makes {text} {got}, not config.json's token {want}")
        ids[text] = want
    added = frozenset(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}))
    return Gemma3ImageConfig(image_token_id=ids[BOI], soft_token_id=ids[IMAGE], eoi_token_id=ids[EOI],
                             tokens_per_image=tokens, size=(side, side), resample=int(pre.get("resample", BILINEAR)),
                             do_convert_rgb=bool(pre.get("do_convert_rgb", True)),
                             do_resize=bool(pre.get("do_resize", True)), tokenizer=tokenizer,
                             added=added | set(ids.values()))


def resize_image(config: Gemma3ImageConfig, image: Image.Image) -> tuple[int, int, bytes]:
    """(height, width, RGB uint8 bytes) of an RGB PIL image (decoded and converted by the caller)."""
    if config.do_resize:
        image = image.resize((config.size[1], config.size[0]), resample=config.resample)
    pixels = np.ascontiguousarray(np.asarray(image, dtype=np.uint8))
    return pixels.shape[0], pixels.shape[1], pixels.tobytes()


def expand(config: Gemma3ImageConfig, prompt_ids: list[int],
           images: list[tuple[int, int, bytes]]) -> tuple[list[int], list[ImageInput]]:
    """(the prompt with each <start_of_image> expanded as Gemma3Processor expands it, one ImageInput per image over
    its <image_soft_token>s), from a prompt with one <start_of_image> per image and the resized images in order."""
    check_image_tokens(prompt_ids, config.image_token_id, len(images))
    tokenizer, newlines = config.tokenizer, "\n\n"
    out: list[int] = []
    placed: list[ImageInput] = []
    piece: list[int] = []  # the text piece being read (ids between added tokens)
    after_image = False  # the piece follows an image: "\n\n" goes ahead of it

    def close(before_image: bool) -> None:
        nonlocal piece, after_image
        if after_image or before_image:
            text = tokenizer.decode(piece, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            text = (newlines if after_image else "") + text + (newlines if before_image else "")
            out.extend(tokenizer.encode(text, add_special_tokens=False))
        else:
            out.extend(piece)
        piece, after_image = [], False

    for token in prompt_ids:
        if token == config.image_token_id:
            close(True)
            height, width, data = images[len(placed)]
            placed.append(image_input(len(out) + 1, config.tokens_per_image, height, width, data))
            out += [token] + [config.soft_token_id] * config.tokens_per_image + [config.eoi_token_id]
            after_image = True
        elif token in config.added:
            close(False)
            out.append(token)
        else:
            piece.append(token)
    close(False)
    return out, placed

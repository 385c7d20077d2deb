"""Idefics3 / SmolVLM's image front end, without torch: an RGB image -> its tiles (each one
ImageInput of the tower's image_size square), and a prompt's `<image>` tokens -> the processor's
expansion around them.

What transformers' Idefics3ImageProcessor (SmolVLMImageProcessor is the same) does before rescale and
normalize, from preprocessor_config.json: resize so the longest edge is size["longest_edge"] keeping
the aspect ratio (the short edge int(long / aspect), rounded up to even, at most 4096 a side), resample
LANCZOS unless the file names another; with do_image_splitting, resize each side up to a multiple of
max_image_size["longest_edge"] (M), cut it into M x M tiles row-major and add the whole image resized
to M x M (the global view; an image that is M x M after that step is the global view alone); without
splitting, the resized image to M x M. Every frame is M x M, so do_pad (the batch's zero padding) never
reaches a pixel of an image processed alone. M must be the vision tower's image_size.

Idefics3Processor's prompt: each `<image>` becomes, for a split image of R rows and C columns,
per tile `<fake_token_around_image><row_{r}_col_{c}>` + `<image>` * image_seq_len, "\n" after each
row, then "\n<fake_token_around_image><global-img>" + `<image>` * image_seq_len +
`<fake_token_around_image>`; for an unsplit one that last part without its "\n". The processor
tokenizes the whole expanded text; the expansion is bounded by added tokens, so its token ids are
the same wherever it sits. They are read from the model's tokenizer once (the pieces: the fake token,
the global tag, each row/column tag, the "\n" and "\n\n" between an image token and the fake token)
and checked against tokenizing whole expanded prompts, so no tokenizer is needed per request.

What the worker gets: per image, its rows x cols tiles (row-major) then its global view, each one
ImageInput of image_size x image_size RGB over image_seq_len (vision num_image_tokens) image tokens;
no pixel of a frame is padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from pagedserve.common.multimodal import ImageInput, check_image_tokens, image_input

FAKE, IMAGE, GLOBAL = "<fake_token_around_image>", "<image>", "<global-img>"
MAX_SIDE = 4096  # the image processor's MAX_IMAGE_SIZE: no side is resized past it
LANCZOS = 1  # PIL's Image.Resampling.LANCZOS, the image processor's default


@dataclass(frozen=True)
class Idefics3Config:
    """How one Idefics3 / SmolVLM model's images are prepared and expanded in the prompt."""
    image_token_id: int
    tokens_per_image: int  # image_seq_len: placeholders per tile (and per global view)
    tile: int  # max_image_size["longest_edge"], the vision tower's image_size
    longest_edge: int | None = None  # size["longest_edge"] (or resize_hw below)
    resize_hw: tuple[int, int] | None = None
    resample: int = LANCZOS
    do_convert_rgb: bool = True
    do_resize: bool = True
    do_image_splitting: bool = True
    # token ids of the expansion's pieces (read_pieces)
    fake: tuple[int, ...] = ()
    global_tag: tuple[int, ...] = ()
    newline: tuple[int, ...] = ()  # "\n" after a row, before the next row's fake token
    last_newline: tuple[int, ...] = ()  # "\n\n" after the last row, before the global view's fake token
    row_col: tuple[tuple[tuple[int, ...], ...], ...] = ()  # row_col[r][c]: `<row_{r+1}_col_{c+1}>`


@dataclass(frozen=True)
class TiledImage:
    """One image as the processor prepares it: rows x cols tiles (0 x 0: not split), then the global
    view; each frame tile x tile RGB uint8 bytes, row-major."""
    rows: int
    cols: int
    tile: int
    frames: tuple[bytes, ...]


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """The processor's get_resize_output_image_size: the long edge to `longest`, the short one
    int(long / aspect) rounded up to even; then no side past MAX_SIDE."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_SIDE:
        width = MAX_SIDE
        height = int(width / aspect)
    elif height > width and height > MAX_SIDE:
        height = MAX_SIDE
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def _multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """The processor's resize_for_vision_encoder: each side up to a multiple of tile (the short one
    from the long one's new length over the aspect ratio)."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def _resize(image: Image.Image, height: int, width: int, resample: int) -> Image.Image:
    return image.resize((width, height), resample=resample)


def tile_image(config: Idefics3Config, image: Image.Image) -> TiledImage:
    """The tiles and global view of an RGB PIL image (decoded and converted by the caller)."""
    if config.do_resize:
        width, height = image.size
        if config.resize_hw is not None:
            height, width = config.resize_hw
        else:
            height, width = _longest_edge_size(height, width, config.longest_edge)
        image = _resize(image, height, width, config.resample)
    tile = config.tile
    rows = cols = 0
    if config.do_image_splitting:
        width, height = image.size
        image = _resize(image, *_multiple_size(height, width, tile), config.resample)
        width, height = image.size
        if height > tile or width > tile:
            rows, cols = height // tile, width // tile
    frames = []
    if rows:
        if rows > len(config.row_col) or cols > len(config.row_col[0]):
            raise ValueError(f"the image makes {rows}x{cols} tiles: this model's processor makes at most "
                             f"{len(config.row_col)}x{len(config.row_col[0])}")
        pixels = np.asarray(image, dtype=np.uint8)
        for r in range(rows):
            for c in range(cols):
                frames.append(np.ascontiguousarray(pixels[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile]).tobytes())
    whole = _resize(image, tile, tile, config.resample)
    frames.append(np.asarray(whole, dtype=np.uint8).tobytes())
    return TiledImage(rows, cols, tile, tuple(frames))


def image_ids(config: Idefics3Config, rows: int, cols: int) -> tuple[list[int], list[int]]:
    """(the token ids one `<image>` becomes, the offsets in them of each frame's image tokens)."""
    ids: list[int] = []
    starts: list[int] = []
    run = [config.image_token_id] * config.tokens_per_image
    for r in range(rows):
        for c in range(cols):
            ids += config.fake + config.row_col[r][c]
            starts.append(len(ids))
            ids += run
        ids += config.newline if r < rows - 1 else config.last_newline
    ids += config.fake + config.global_tag
    starts.append(len(ids))
    ids += run + list(config.fake)
    return ids, starts


def image_text(rows: int, cols: int, seq_len: int) -> str:
    """Idefics3Processor's text for one `<image>` (its replace_image_token)."""
    tail = f"{FAKE}{GLOBAL}{IMAGE * seq_len}{FAKE}"
    if rows == 0 and cols == 0:
        return tail
    text = ""
    for r in range(rows):
        for c in range(cols):
            text += f"{FAKE}<row_{r + 1}_col_{c + 1}>{IMAGE * seq_len}"
        text += "\n"
    return text + "\n" + tail


def expand(config: Idefics3Config, prompt_ids: list[int],
           images: list[TiledImage]) -> tuple[list[int], list[ImageInput]]:
    """(the prompt with each image token expanded as the processor expands it, one ImageInput per
    tile and global view over its image tokens), from a prompt with one image token per image."""
    check_image_tokens(prompt_ids, config.image_token_id, len(images))
    out: list[int] = []
    placed: list[ImageInput] = []
    seen = 0
    for token in prompt_ids:
        if token != config.image_token_id:
            out.append(token)
            continue
        image = images[seen]
        seen += 1
        ids, starts = image_ids(config, image.rows, image.cols)
        for start, frame in zip(starts, image.frames, strict=True):
            placed.append(image_input(len(out) + start, config.tokens_per_image, image.tile, image.tile, frame))
        out += ids
    return out, placed


def _between(tokenizer, text: str, before: list[int], after: list[int]) -> tuple[int, ...]:
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if ids[:len(before)] != before or (after and ids[len(ids) - len(after):] != after):
        raise ValueError(f"the tokenizer does not keep {FAKE} and {IMAGE} whole around {text!r}")
    return tuple(ids[len(before):len(ids) - len(after)])


def read_pieces(tokenizer, image_token_id: int, seq_len: int, max_grid: int) -> dict:
    """The expansion's token ids from the model's tokenizer (Idefics3Config's fields), checked
    against tokenizing whole expanded prompts; ValueError when the tokenizer cannot give them."""
    image = list(tokenizer.encode(IMAGE, add_special_tokens=False))
    fake = list(tokenizer.encode(FAKE, add_special_tokens=False))
    if image != [image_token_id]:
        raise ValueError(f"the tokenizer makes {IMAGE} {image}, not config.json's image token {image_token_id}")
    if len(fake) != 1:
        raise ValueError(f"the tokenizer has no {FAKE} token (it makes {fake})")
    pieces = dict(
        fake=tuple(fake),
        global_tag=_between(tokenizer, FAKE + GLOBAL + IMAGE, fake, image),
        newline=_between(tokenizer, IMAGE + "\n" + FAKE, image, fake),
        last_newline=_between(tokenizer, IMAGE + "\n\n" + FAKE, image, fake),
        row_col=tuple(tuple(_between(tokenizer, f"{FAKE}<row_{r + 1}_col_{c + 1}>{IMAGE}", fake, image)
                            for c in range(max_grid)) for r in range(max_grid)))
    probe = Idefics3Config(image_token_id, seq_len, 1, **pieces)
    for rows, cols in {(0, 0), (1, min(2, max_grid)), (min(2, max_grid), 1), (min(3, max_grid),) * 2}:
        text = "User:" + IMAGE + " what?\n" + IMAGE + "\nAssistant: "
        want = list(tokenizer.encode(text.replace(IMAGE, image_text(rows, cols, seq_len)), add_special_tokens=False))
        prompt = list(tokenizer.encode(text, add_special_tokens=False))
        frames = (b"\0\0\0",) * (rows * cols + 1)
        got = expand(probe, prompt, [TiledImage(rows, cols, 1, frames)] * 2)[0]
        if got != want:
            raise ValueError(f"the tokenizer does not tokenize {IMAGE}'s expansion piece by piece "
                             f"(a {rows}x{cols} image); its prompts cannot be expanded in token ids")
    return pieces


def max_grid(config_tile: int, longest_edge: int | None, resize_hw: tuple[int, int] | None, do_resize: bool) -> int:
    """The most tile rows (or columns) an image can make: the long edge after the resize (plus its
    rounding to even), in tiles; without a resize, MAX_SIDE's."""
    if not do_resize:
        longest = MAX_SIDE
    elif resize_hw is not None:
        longest = max(resize_hw)
    else:
        longest = min(longest_edge, MAX_SIDE)
    return max(1, math.ceil((longest + 1) / config_tile))

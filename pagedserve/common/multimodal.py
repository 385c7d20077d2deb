"""Images in a prompt, as they cross the services: the front end decodes and resizes, the worker
normalizes and encodes.

An ImageInput is one image of a request's prompt, already through its model's resize and crop
(RGB, uint8, height x width x 3, row-major), and where its placeholder tokens sit in the prompt:
`length` copies of the model's image token from `offset`. The worker's vision encoder turns it into
exactly `length` embedding rows, which replace those tokens' embeddings. `hash` (content_hash)
keys the prefix cache: a block that holds an image's first placeholder hashes it too, so two
prompts share KV past an image only when the image is the same.

No torch: the gateway, tokenizer and scheduler use this module.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ImageInput:
    offset: int  # prompt position of its first placeholder token
    length: int  # its placeholder tokens: the encoder's rows for it
    height: int
    width: int
    data: bytes = b""  # RGB uint8, height x width x 3, row-major
    hash: str = ""  # content_hash(height, width, data)

    @property
    def end(self) -> int:
        return self.offset + self.length


def content_hash(height: int, width: int, data: bytes) -> str:
    return hashlib.sha256(b"%d:%d:" % (height, width) + data).hexdigest()


def image_input(offset: int, length: int, height: int, width: int, data: bytes) -> ImageInput:
    if len(data) != height * width * 3:
        raise ValueError(f"an image of {height}x{width} RGB needs {height * width * 3} bytes, not {len(data)}")
    return ImageInput(offset, length, height, width, data, content_hash(height, width, data))


def check_image_tokens(prompt_ids: list[int], image_token_id: int, num_images: int) -> None:
    """A rendered prompt holds one image token per image (before the front end expands them)."""
    found = sum(1 for t in prompt_ids if t == image_token_id)
    if found != num_images:
        raise ValueError(f"the prompt has {found} image tokens (id {image_token_id}) for {num_images} "
                         "images: each image needs exactly one")


def expand_images(prompt_ids: list[int], image_token_id: int, images, span_of) -> tuple[list[int], list[ImageInput]]:
    """(the prompt with each image token, one per image, replaced by span_of(height, width): the image's
    placeholder tokens; one ImageInput per image over its span), for images (height, width, RGB bytes) in
    prompt order."""
    check_image_tokens(prompt_ids, image_token_id, len(images))
    out: list[int] = []
    placed: list[ImageInput] = []
    for token in prompt_ids:
        if token != image_token_id:
            out.append(token)
            continue
        height, width, data = images[len(placed)]
        span = span_of(height, width)
        placed.append(image_input(len(out), len(span), height, width, data))
        out.extend(span)
    return out, placed


def check_placements(images: list[ImageInput] | tuple[ImageInput, ...], num_prompt_tokens: int) -> None:
    """Images in prompt order, not overlapping, inside the prompt."""
    end = 0
    for image in images:
        if image.offset < end or image.length <= 0 or image.end > num_prompt_tokens:
            raise ValueError(f"image placeholders at {image.offset}..{image.end} do not fit a prompt of "
                             f"{num_prompt_tokens} tokens in order")
        end = image.end


def image_to_proto(image: ImageInput, out) -> None:
    out.offset, out.length, out.height, out.width = image.offset, image.length, image.height, image.width
    out.data, out.hash = image.data, image.hash


def image_from_proto(msg) -> ImageInput:
    return ImageInput(msg.offset, msg.length, msg.height, msg.width, bytes(msg.data),
                      msg.hash or content_hash(msg.height, msg.width, bytes(msg.data)))


def images_to_json(images) -> str:
    """The images of a request's durable record (common/store.py): JSON, pixels in base64."""
    return json.dumps([{"offset": i.offset, "length": i.length, "height": i.height, "width": i.width,
                        "hash": i.hash, "data": base64.b64encode(i.data).decode()} for i in images])


def images_from_json(text: str) -> tuple[ImageInput, ...]:
    return tuple(ImageInput(e["offset"], e["length"], e["height"], e["width"], base64.b64decode(e["data"]), e["hash"])
                 for e in json.loads(text)) if text else ()

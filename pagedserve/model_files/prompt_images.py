"""A prompt's images in vLLM's request shapes, for the in-process engine (the offline API), and the
data: URL decoding the gateway shares. The preparation is the tokenizer service's
(image_processing.py), so a prompt with images gives the same tokens and ImageInputs on every path:

  - LLM.generate({"prompt": text, "multi_modal_data": {"image": image or [images]}}): the text
    (with one image token per image: <image>, or Qwen2-VL's <|vision_start|><|image_pad|><|vision_end|>)
    through chat_templates.text_token_ids, then prompt_images;
  - LLM.chat(messages with image_url / image_pil / image parts): chat_prompt.

An image is encoded bytes (PNG, JPEG, ...) or a PIL image. Errors are ValueError (and
ChatTemplateError from the template). Pure functions: safe on any thread.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

from PIL import Image

from pagedserve.common.multimodal import ImageInput
from pagedserve.model_files.chat_templates import render_chat, takes_content_lists
from pagedserve.model_files.image_processing import AnyImageConfig, expand_placeholders, process_image

AnImage = bytes | Image.Image


def decode_data_url(url: str) -> bytes:
    """The bytes of a data:image/<type>;base64,<data> URL; ValueError for any other."""
    header, _, payload = url.partition(",")
    if not header.startswith("data:image/") or not header.endswith(";base64"):
        raise ValueError("a data URL must be data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data URL's base64 is not valid") from None


def prompt_images(config: AnyImageConfig, prompt_ids: list[int],
                  images: AnImage | list[AnImage]) -> tuple[list[int], list[ImageInput]]:
    """(the prompt with each image token expanded to its image's placeholders, the ImageInputs for
    engine.add_request(images=...)) for token ids with one image token per image, in order."""
    images = images if isinstance(images, list) else [images]
    return expand_placeholders(config, list(prompt_ids), [process_image(config, image) for image in images])


def _part_image(part: dict, fetch: Callable[[str], bytes] | None) -> AnImage:
    kind = part.get("type")
    if kind == "image_pil" or (kind == "image" and part.get("image") is not None):
        return part.get(kind)  # vLLM's {"type": "image_pil", "image_pil": PIL image}; ours: bytes or PIL
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ValueError(f'an image_url part needs {{"url": ...}}, got {value!r:.80}')
    if url.startswith("data:"):
        return decode_data_url(url)
    if fetch is None:
        raise ValueError(f"{url:.80}: only data: URLs are read here (pass fetch= to read others)")
    return fetch(url)


def chat_images(messages: list[dict], list_content: bool = False,
                fetch: Callable[[str], bytes] | None = None) -> tuple[list[dict], list[AnImage]]:
    """(OpenAI-style messages as the chat template takes them: HF content lists for a message with
    images, [{"type": "image"}, {"type": "text", "text"}]; with list_content every text content as
    a list too; the images in order)."""
    out, images = [], []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(p.get("type") != "text" for p in content):
            parts = []
            for part in content:
                if part.get("type") == "text":
                    parts.append({"type": "text", "text": part.get("text", "")})
                elif part.get("type") in ("image_url", "image_pil", "image"):
                    images.append(_part_image(part, fetch))
                    parts.append({"type": "image"})
                else:
                    raise ValueError(f"content parts must be text or images, got type {part.get('type')!r}")
            message = {**message, "content": parts}
        elif isinstance(content, list):
            text = "\n".join(p.get("text", "") for p in content)
            message = {**message, "content": [{"type": "text", "text": text}] if list_content else text}
        elif list_content:  # as vLLM's "openai" content format: a string is one text part, None none
            message = {**message, "content": [{"type": "text", "text": content}] if isinstance(content, str) else []}
        out.append(message)
    return out, images


def chat_prompt(tokenizer, config: AnyImageConfig | None, messages: list[dict], *, chat_template: str | None = None,
                fetch: Callable[[str], bytes] | None = None,
                **options: Any) -> tuple[list[int], list[ImageInput], str]:
    """(expanded token ids, ImageInputs, prompt text) of a chat with images, rendered as the
    tokenizer service renders it (render_chat's options: add_generation_prompt, ...)."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    list_content = config is not None and takes_content_lists(template)
    rendered, images = chat_images(messages, list_content, fetch)
    if images and config is None:
        raise ValueError("the model does not take images")
    text = render_chat(tokenizer, rendered, chat_template=chat_template, **options)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if config is None:
        return ids, [], text
    ids, placed = prompt_images(config, ids, images)
    return ids, placed, text

"""What the image front end's tests (test_pixtral_images.py, test_qwen_vl_images.py, test_idefics3_images.py)
share: random images of many shapes and modes, their encodings, the processor's chat of images, and the offline
path's encoding of the chat the tokenizer service gets."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    """A random RGB image."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def shaped_images(shapes: list[tuple[int, int]]) -> list[tuple[str, Image.Image]]:
    """(name, image): a random RGB image of each (width, height), then an RGBA, a gray, a palette and an LA one."""
    rng = np.random.default_rng(1)
    out = [(f"{w}x{h}", rgb(w, h, i)) for i, (w, h) in enumerate(shapes)]
    return out + [("rgba", Image.fromarray(rng.integers(0, 256, (41, 29, 4), dtype=np.uint8), "RGBA")),
                  ("gray", Image.fromarray(rng.integers(0, 256, (33, 71), dtype=np.uint8), "L")),
                  ("palette", rgb(61, 45, 9).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)),
                  ("la", Image.fromarray(rng.integers(0, 256, (30, 60, 2), dtype=np.uint8), "LA"))]


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    """The image's file bytes in the format."""
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def chat(count: int, text: str = "What is in these?") -> list[dict]:
    """A one-turn chat of `count` image parts, then the text, for a processor's chat template."""
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(count)), {"type": "text", "text": text}]}]


def offline_chat(tokenizer, config, data: list[bytes]):
    """chat_prompt (LLM.chat's encoding) of the tokenizer service's chat of the images (a system "Be brief.",
    then the images as data: URLs and "What is in these?"): (ids, ImageInputs, text)."""
    from pagedserve.model_files.prompt_images import chat_prompt

    urls = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(d).decode()}}
            for d in data]
    return chat_prompt(tokenizer, config, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [*urls, {"type": "text", "text": "What is in these?"}]}])

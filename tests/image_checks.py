"""What the image front end's tests (test_pixtral_images.py, test_qwen_vl_images.py, test_idefics3_images.py)
share: random images of many shapes and modes, their encodings, the processor's chat of images, the offline
path's encoding of the chat the tokenizer service gets, and that service's run of it (check_tokenizer_service)."""

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


def check_tokenizer_service(folder, processor, check_images) -> None:
    """A chat with two images through the tokenizer service (a fake scheduler behind it): ScheduleRequest's
    prompt_token_ids are the processor's, usage counts the expanded prompt, /tokenize gives the same ids and
    text, the offline path (chat_prompt, LLM.chat's) the same ids and ImageInputs, ModelInfo.takes_images;
    check_images(theirs, want, got, config) checks the family's ImageInputs sent (theirs: the processor's
    output with rescale and normalize off, want: its ids)."""
    import asyncio

    from pagedserve.common.multimodal import image_from_proto
    from pagedserve.model_files import image_processing as ip
    from pagedserve.model_files.tokenizer_files import load_tokenizer
    from pagedserve.v1 import generate_pb2
    from test_tokenizer_images import chat_with_images
    from test_tokenizer_service import collect, start_stack, streamer

    tokenizer = load_tokenizer(folder)
    config = ip.image_config(folder, tokenizer)
    data = [encoded(rgb(300, 200, 11)), encoded(rgb(45, 38, 12))]
    text = processor.apply_chat_template(
        [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *chat(2)], add_generation_prompt=True)
    theirs = processor(text=text, images=[Image.open(io.BytesIO(d)) for d in data], return_tensors="np",
                       add_special_tokens=False, do_rescale=False, do_normalize=False)
    want = [int(t) for t in theirs["input_ids"][0]]

    async def main():
        stub, fake, _, _, stop = await start_stack(tokenizer, [streamer([5, 6])], images=config)
        try:
            assert (await stub.GetModelInfo(generate_pb2.ModelInfoRequest())).takes_images
            res = await collect(stub, chat_with_images(*data))
            sent = fake.requests[0]
            assert list(sent.prompt_token_ids) == want
            got = [image_from_proto(m) for m in sent.images]
            assert len(got) == 2
            check_images(theirs, want, got, config)
            assert res[0].accepted and res[0].usage.prompt_tokens == len(want)
            ids, offline, _ = offline_chat(tokenizer, config, data)
            assert ids == want and offline == got
            tokenized = await stub.Tokenize(generate_pb2.TokenizeRequest(chat=chat_with_images(*data).chat))
            assert list(tokenized.token_ids) == want and tokenized.text == text
        finally:
            await stop()
    asyncio.run(main())

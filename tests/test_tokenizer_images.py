"""The tokenizer service with images: a chat with image parts, for a tiny llava-1.5-style model
folder (tests/tiny_llava.py), reaches the (scripted) scheduler as the expanded prompt and
ScheduleRequest.images; usage counts the expanded prompt; the refusals (a text model, an image
URL, a count mismatch, a non-image) are INVALID_ARGUMENT before the scheduler sees anything."""

from __future__ import annotations

import asyncio
import base64
import io
import re

import grpc
import numpy as np
import pytest
from PIL import Image

from pagedserve.common.multimodal import image_from_proto
from pagedserve.model_files import image_processing as ip
from pagedserve.model_files.prompt_images import chat_prompt
from pagedserve.model_files.tokenizer_files import load_tokenizer
from pagedserve.v1 import generate_pb2
from test_tokenizer_service import collect, start_stack, streamer
from tiny_llava import build_tiny_llava


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory):
    from pagedserve.model_files.default_model import resolve_model
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), resolve_model(None))


def png(seed: int, size=(45, 38)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def chat_with_images(*images: bytes, text: str = "What is in these?") -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(request_id="img-1")
    req.chat.add_generation_prompt = True
    req.chat.messages.add(role="system", content="Be brief.")
    message = req.chat.messages.add(role="user")
    for data in images:
        message.parts.add(image=data)
    message.parts.add(text=text)
    return req


def test_a_chat_with_images_reaches_the_scheduler_expanded(llava_folder):
    tokenizer = load_tokenizer(llava_folder)
    config = ip.image_config(llava_folder)
    images = [png(1), png(2, (20, 64))]

    async def main():
        stub, fake, _, _, stop = await start_stack(tokenizer, [streamer([5, 6])], images=config)
        try:
            info = await stub.GetModelInfo(generate_pb2.ModelInfoRequest())
            assert info.takes_images
            res = await collect(stub, chat_with_images(*images))
            sent = fake.requests[0]
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                 {"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                              {"type": "text", "text": "What is in these?"}]}],
                tokenize=False, add_generation_prompt=True)
            assert text.startswith("Be brief. USER: <image>\n<image>\nWhat is in these? ASSISTANT:")
            want, placed = ip.expand_placeholders(config, tokenizer.encode(text, add_special_tokens=False),
                                                  [ip.process_image(config, d) for d in images])
            assert list(sent.prompt_token_ids) == want
            got = [image_from_proto(m) for m in sent.images]
            assert got == placed and [g.length for g in got] == [9, 9]
            assert got[0].end <= got[1].offset and len(got[1].data) == 30 * 30 * 3
            assert res[0].accepted and res[0].usage.prompt_tokens == len(want)
            # the offline engine's path (model_files/prompt_images.py) gives the same prompt and images
            urls = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(d).decode()}}
                    for d in images]
            ids, offline, _ = chat_prompt(tokenizer, config, [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [*urls, {"type": "text", "text": "What is in these?"}]}])
            assert ids == want and offline == placed
            tokenized = await stub.Tokenize(generate_pb2.TokenizeRequest(chat=chat_with_images(*images).chat))
            assert list(tokenized.token_ids) == want and tokenized.text == text  # /tokenize counts them expanded
        finally:
            await stop()
    asyncio.run(main())


@pytest.mark.parametrize("case, message", [
    ("text-model", "does not take images"),
    ("url", "image_url part is not taken"),
    ("not-an-image", "image 0 of the chat: the data is not an image"),
    ("count", "2 image tokens .* for 1 images"),
])
def test_refusals_are_invalid_argument(llava_folder, case, message):
    tokenizer = load_tokenizer(llava_folder)
    config = None if case == "text-model" else ip.image_config(llava_folder)
    req = chat_with_images(b"GIF89a-not-really" if case == "not-an-image" else png(3))
    if case == "url":
        req.chat.messages[1].parts.add(image_url="https://example.com/cat.png")
    if case == "count":  # the text names a second image the request does not carry
        req.chat.messages[1].parts[1].text = "and <image> here?"

    async def main():
        stub, fake, _, _, stop = await start_stack(tokenizer, [], images=config)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert re.search(message, err.value.details()), err.value.details()
            assert not fake.requests
        finally:
            await stop()
    asyncio.run(main())


def test_list_content_messages_as_vllms_openai_format():
    """The service renders a list-taking template's string content as one text part, an empty one too,
    and an assistant's calls without content as no part (tokenizer/chat_render.template_messages)."""
    from pagedserve.tokenizer.chat_render import template_messages
    from pagedserve.v1 import generate_pb2

    call = generate_pb2.ToolCall(id="c", name="f", arguments="{}")
    chat = generate_pb2.ChatMessages(messages=[
        generate_pb2.ChatMessage(role="user", content="Hi"), generate_pb2.ChatMessage(role="assistant", content=""),
        generate_pb2.ChatMessage(role="assistant", tool_calls=[call])])
    messages, _ = template_messages(chat, list_content=True)
    assert [m["content"] for m in messages] == [[{"type": "text", "text": "Hi"}], [{"type": "text", "text": ""}], []]
    assert [m["content"] for m in template_messages(chat)[0]] == ["Hi", "", ""]

"""The gateway in front of the real tokenizer service for a tiny Qwen2-VL (tests/tiny_qwen2_vl.py), the
scheduler scripted (tests/test_tokenizer_service.py's FakeScheduler): an OpenAI image_url data: URL, an
Anthropic base64 block and a Responses input_image (after its text) are accepted and reach the
scheduler as the processor's prompt and images; usage, /tokenize and /v1/messages/count_tokens count
the expanded prompt as transformers' Qwen2VLProcessor does; more images than --limit-mm-per-prompt, a
non-image and an image the model cannot take (an aspect ratio over 200) are 400s and nothing reaches
the scheduler.

Everything runs on the test's one event loop (the gateway through httpx's ASGI transport)."""

from __future__ import annotations

import asyncio
import base64
import io

import grpc
import httpx
import numpy as np
import pytest
from PIL import Image

from pagedserve.common.grpc_util import free_port
from pagedserve.model_files import image_processing as ip
from pagedserve.model_files.tokenizer_files import load_tokenizer
from test_tokenizer_service import FakeScheduler, streamer
from tiny_qwen2_vl import build_tiny_qwen2_vl, reference_processor


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from pagedserve.model_files.default_model import resolve_model
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl-gateway"), resolve_model(None))


def png(width: int, height: int, seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def expected_ids(folder, data: list[bytes], question: str, text_first: bool = False) -> list[int]:
    """Qwen2VLProcessor's input_ids for one user turn of these images then the question (or the
    question first)."""
    processor = reference_processor(folder)
    content = [*({"type": "image"} for _ in data)]
    content.insert(0 if text_first else len(content), {"type": "text", "text": question})
    messages = [{"role": "user", "content": content}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    theirs = processor(text=text, images=[Image.open(io.BytesIO(d)) for d in data], return_tensors="np",
                       add_special_tokens=False)
    return [int(t) for t in theirs["input_ids"][0]]


async def serve(folder, scripts: int):
    """(an httpx client on the gateway, the fake scheduler, stop): the real TokenizerService on the
    folder's tokenizer and image config, the gateway's Backend pointing at it."""
    from pagedserve.gateway.app import build_app
    from pagedserve.gateway.backend import Backend
    from pagedserve.gateway.images import MediaPolicy
    from pagedserve.tokenizer.server import TokenizerServicer
    from pagedserve.tokenizer.service import TokenizerService
    from pagedserve.v1 import generate_pb2_grpc, scheduler_pb2_grpc

    tokenizer = load_tokenizer(folder)
    fake = FakeScheduler([streamer([5, 6]) for _ in range(scripts)])
    sched_server, sched_port = grpc.aio.server(), free_port()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, sched_server)
    sched_server.add_insecure_port(f"127.0.0.1:{sched_port}")
    await sched_server.start()
    service = TokenizerService(tokenizer, "tiny-qwen2-vl", f"127.0.0.1:{sched_port}", 5.0,
                               images=ip.image_config(folder, tokenizer), local_links=False)
    server, port = grpc.aio.server(), free_port()
    generate_pb2_grpc.add_TokenizerServicer_to_server(TokenizerServicer(service), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    backend = Backend(f"127.0.0.1:{port}", f"127.0.0.1:{sched_port}", local_links=False)
    backend.media = MediaPolicy(max_images=2)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(backend)), base_url="http://gw",
                             timeout=30)

    async def stop():
        await http.aclose()
        await server.stop(None)
        await sched_server.stop(None)
        await service.close()
    return http, fake, stop


def test_openai_and_anthropic_images_are_counted_and_sent_as_the_processor_expands_them(folder):
    wide, small = png(300, 200, 1), png(45, 38, 2)
    question = "What is in these?"
    want = expected_ids(folder, [wide, small], question)
    want_one = expected_ids(folder, [wide], question)
    parts = [{"type": "image_url", "image_url": {"url": data_url(wide)}},
             {"type": "image_url", "image_url": {"url": data_url(small)}}, {"type": "text", "text": question}]
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(wide).decode()}
    blocks = [{"type": "image", "source": source}, {"type": "text", "text": question}]

    async def main():
        http, fake, stop = await serve(folder, scripts=3)
        try:
            r = await http.post("/v1/chat/completions", json={
                "model": "tiny-qwen2-vl", "max_tokens": 2, "messages": [{"role": "user", "content": parts}]})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(want)
            assert list(fake.requests[-1].prompt_token_ids) == want
            assert [(i.height, i.width, i.length) for i in fake.requests[-1].images] == [(168, 252, 54), (56, 84, 6)]
            r = await http.post("/v1/messages", json={"model": "tiny-qwen2-vl", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": blocks}]})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]  # (the scripted scheduler reports 2 cached tokens)
            assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(want_one)
            assert list(fake.requests[-1].prompt_token_ids) == want_one
            r = await http.post("/v1/messages/count_tokens", json={"model": "tiny-qwen2-vl",
                                                                    "messages": [{"role": "user", "content": blocks}]})
            assert r.status_code == 200 and r.json() == {"input_tokens": len(want_one)}, r.text
            r = await http.post("/tokenize", json={"model": "tiny-qwen2-vl", "add_generation_prompt": True,
                                                   "messages": [{"role": "user", "content": parts}]})
            assert r.status_code == 200 and r.json()["tokens"] == want, r.text
            item = {"role": "user", "content": [{"type": "input_text", "text": question},
                                                {"type": "input_image", "image_url": data_url(small)}]}
            r = await http.post("/v1/responses", json={"model": "tiny-qwen2-vl", "max_output_tokens": 2,
                                                        "input": [item], "store": False})
            assert r.status_code == 200, r.text
            assert list(fake.requests[-1].prompt_token_ids) == expected_ids(folder, [small], question, True)
            assert len(fake.requests) == 3
        finally:
            await stop()
    asyncio.run(main())


@pytest.mark.parametrize("content, words", [
    ([{"type": "image_url", "image_url": {"url": data_url(png(30, 30, 3))}}] * 3, "3 images: at most 2 per request"),
    ([{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": data_url(b"plain text")}}],
     "messages[0].content[1].image_url: the data is not an image"),
    ([{"type": "image_url", "image_url": {"url": data_url(png(402, 2, 4))}}, {"type": "text", "text": "x"}],
     "aspect ratio must be smaller than 200"),
])
def test_refusals_are_400s_that_reach_no_scheduler(folder, content, words):
    async def main():
        http, fake, stop = await serve(folder, scripts=0)
        try:
            r = await http.post("/v1/chat/completions", json={
                "model": "tiny-qwen2-vl", "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
            assert not fake.requests
        finally:
            await stop()
    asyncio.run(main())

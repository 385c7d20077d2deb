"""Images on the gateway (gateway/images.py) in front of the fake services (tests/fake_services.py):
OpenAI image_url parts (data: and http URLs, fetched from a local HTTP server), Anthropic image
blocks, the Responses API's input_image and the public gRPC API's ContentPart reach the tokenizer
as ChatMessage.parts with the image's bytes; the 400s name the part (bad base64, not an image,
too many, a text model, an unknown part type, a URL too large, too slow or on a host not allowed)."""

from __future__ import annotations

import base64
import dataclasses
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import numpy as np
import pytest
from PIL import Image

from fake_services import KEY, MODEL, Stack
from pagedserve.gateway.images import MediaPolicy
from pagedserve.v1 import generate_pb2, generate_pb2_grpc


def png(seed: int = 0, size=(12, 9)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


CAT = png(1)


class Images(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        if self.path == "/slow":
            time.sleep(10)  # far past the 1 s the test allows it
        body = {"/cat.png": CAT, "/slow": CAT, "/big": b"\0" * 50_000, "/text": b"hello"}.get(self.path)
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def web():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


# a fetch from the local server takes milliseconds; 10 s leaves a loaded CI machine room (the slow test sets 1 s)
POLICY = MediaPolicy(max_images=2, fetch_timeout_s=10.0, max_bytes=10_000)


@pytest.fixture(scope="module")
def stack():
    s = Stack(takes_images=True)
    s.backend.media = POLICY
    yield s
    s.close()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def chat(stack, content, path="/v1/chat/completions"):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "system", "content": "hi"},
                                                          {"role": "user", "content": content}]}
    return httpx.post(stack.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=20)


def parts_sent(stack) -> list:
    return [(p.WhichOneof("part"), p.text if p.HasField("text") else p.image)
            for p in stack.tokenizer.requests[-1].chat.messages[1].parts]


def test_data_and_http_urls_reach_the_tokenizer_as_bytes(stack, web):
    r = chat(stack, [{"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": data_url(CAT)}},
                     {"type": "image_url", "image_url": web + "/redirect"}])
    assert r.status_code == 200, r.text
    assert parts_sent(stack) == [("text", "what?"), ("image", CAT), ("image", CAT)]
    assert stack.tokenizer.requests[-1].chat.messages[0].content == "hi"  # a text message: content, no parts
    assert not stack.tokenizer.requests[-1].chat.messages[0].parts


@pytest.mark.parametrize("content, status, words", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@notbase64"}}], 400,
     "messages[1].content[0].image_url: the data URL's base64 is not valid"),
    ([{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": data_url(b"plain text")}}], 400,
     "messages[1].content[1].image_url: the data is not an image"),
    ([{"type": "image_url", "image_url": {"url": data_url(CAT)}}] * 3, 400, "3 images: at most 2 per request"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, {"type": "text", "text": "x"}], 400,
     "messages[1].content[0]: content parts must be text or image_url, got type 'input_audio'"),
    ([{"type": "image_url", "image_url": {"url": "ftp://x/cat.png"}}], 400, "must be http(s)"),
])
def test_bad_images_are_400_naming_the_part(stack, content, status, words):
    before = len(stack.tokenizer.requests)
    r = chat(stack, content)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
    assert len(stack.tokenizer.requests) == before  # nothing went downstream


@pytest.mark.parametrize("path, words", [
    ("/big", "has 50000 bytes: at most 10000"),
    ("/slow", "took more than 1 s (--media-fetch-timeout)"),
    ("/missing", "answered HTTP 404"),
    ("/text", "the data is not an image"),
])
def test_url_fetch_refusals(stack, web, path, words):
    """Each refused without waiting for anything more: the slow server's 10 s, or (the others) the fetch timeout."""
    stack.backend.media = dataclasses.replace(POLICY, fetch_timeout_s=1.0) if path == "/slow" else POLICY
    start = time.monotonic()
    try:
        r = chat(stack, [{"type": "image_url", "image_url": {"url": web + path}}])
    finally:
        stack.backend.media = POLICY
    assert r.status_code == 400 and "messages[1].content[0].image_url" in r.text and words in r.text, r.text
    assert time.monotonic() - start < 8


def test_allowed_media_domains(stack, web):
    stack.backend.media = dataclasses.replace(POLICY, allowed_domains=("images.example.com",))
    try:
        r = chat(stack, [{"type": "image_url", "image_url": {"url": web + "/cat.png"}}])
        assert r.status_code == 400 and "not allowed (--allowed-media-domains)" in r.text
    finally:
        stack.backend.media = POLICY


def test_a_text_model_refuses_images():
    text_only = Stack()
    try:
        r = chat(text_only, [{"type": "image_url", "image_url": {"url": data_url(CAT)}}])
        assert r.status_code == 400 and "does not take images" in r.json()["error"]["message"]
        r = httpx.post(text_only.url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"}, timeout=20,
                       json={"messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": data_url(CAT)}}]}]})
        assert r.status_code == 400 and "does not take images" in r.json()["error"]["message"]
    finally:
        text_only.close()


def test_anthropic_and_responses_images(stack, web):
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(CAT).decode()}
    blocks = [{"type": "image", "source": source},
              {"type": "image", "source": {"type": "url", "url": web + "/cat.png"}},
              {"type": "text", "text": "compare"}]
    r = httpx.post(stack.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=20,
                   json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": blocks}]})
    assert r.status_code == 200, r.text
    sent = stack.tokenizer.requests[-1].chat.messages[-1].parts
    assert [(p.WhichOneof("part"), p.image or p.text) for p in sent] == [("image", CAT), ("image", CAT),
                                                                           ("text", "compare")]
    item = {"role": "user", "content": [{"type": "input_text", "text": "what?"},
                                        {"type": "input_image", "image_url": data_url(CAT), "detail": "auto"}]}
    r = httpx.post(stack.url + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, timeout=20,
                   json={"model": MODEL, "max_output_tokens": 2, "input": [item], "store": False})
    assert r.status_code == 200, r.text
    sent = stack.tokenizer.requests[-1].chat.messages[-1].parts
    assert [(p.WhichOneof("part"), p.image or p.text) for p in sent] == [("text", "what?"), ("image", CAT)]


def test_grpc_generate_takes_image_parts(stack, web):
    channel = grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}")
    stub = generate_pb2_grpc.GenerationStub(channel)
    req = generate_pb2.GenerateRequest(model=MODEL)
    req.params.max_tokens = 2
    message = req.chat.messages.add(role="user")
    message.parts.add(image_url=web + "/cat.png")
    message.parts.add(image=CAT)
    message.parts.add(text="two cats?")
    metadata = (("authorization", f"Bearer {KEY}"),)
    try:
        assert list(stub.Generate(req, metadata=metadata, timeout=20))[0].accepted
        sent = stack.tokenizer.requests[-1].chat.messages[0].parts
        assert [(p.WhichOneof("part"), p.image or p.text) for p in sent] == [("image", CAT), ("image", CAT),
                                                                               ("text", "two cats?")]
        message.parts[1].image = b"not an image"
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, metadata=metadata, timeout=20))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages[0].parts[1]: the data is not an image" in err.value.details()
    finally:
        channel.close()


def test_media_policy_from_the_flags():
    import argparse

    from pagedserve.common.settings_cli import add_settings
    from pagedserve.gateway.images import media_policy

    parser = argparse.ArgumentParser()
    add_settings(parser, "gateway", with_env=False)
    args = parser.parse_args(["--limit-mm-per-prompt", '{"image": 2, "video": 0}', "--allowed-media-domains",
                              "Images.Example.com", "cdn.example.com", "--media-fetch-timeout", "3"])
    assert media_policy(args.limit_mm_per_prompt, args.allowed_media_domains, args.media_fetch_timeout) == \
        MediaPolicy(2, ("images.example.com", "cdn.example.com"), 3.0)
    assert media_policy("", None, 5.0) == MediaPolicy()
    for bad in ('{"image": -1}', "[2]", "image=2"):
        with pytest.raises(ValueError, match="--limit-mm-per-prompt"):
            media_policy(bad, None, 5.0)


def test_the_body_limit_makes_room_for_the_images_a_request_may_carry():
    """--max-body-bytes bounds a text request; a model that takes images also admits as many images as
    --limit-mm-per-prompt allows, each up to the encoded cap in base64, and no more."""
    from pagedserve.gateway.limits import Limits

    noise = Image.fromarray(np.random.default_rng(5).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    out = io.BytesIO()
    noise.save(out, format="PNG")
    image = out.getvalue()  # ~4.8 KB: ~6.4 KB in base64, over the 4,000-byte limit alone
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "what?"}]
    stacks = {takes: Stack(limits=Limits(max_body_bytes=4000), takes_images=takes) for takes in (True, False)}
    try:
        for s in stacks.values():
            s.backend.media = MediaPolicy(max_images=1, max_bytes=10_000)
        assert chat(stacks[True], content).status_code == 200
        assert chat(stacks[False], content).status_code == 413
        # past 4,000 + one image's 13,336 bytes of base64: too large even for an image model
        assert chat(stacks[True], content + [{"type": "text", "text": "x" * 14_000}]).status_code == 413
        # the public gRPC API: the image as bytes passes on the image model; a text model's request over
        # --max-body-bytes is refused as REST's is (gRPC's own cap makes room for images: images.image_room)
        req = generate_pb2.GenerateRequest(model=MODEL)
        req.params.max_tokens = 2
        message = req.chat.messages.add(role="user")
        message.parts.add(image=image)
        message.parts.add(text="what?")
        for takes, s in stacks.items():
            with grpc.insecure_channel(f"127.0.0.1:{s.grpc_port}") as channel:
                call = generate_pb2_grpc.GenerationStub(channel).Generate(
                    req, metadata=(("authorization", f"Bearer {KEY}"),), timeout=20)
                if takes:
                    assert list(call)[0].accepted
                else:
                    with pytest.raises(grpc.RpcError) as err:
                        list(call)
                    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "--max-body-bytes (4000 bytes)" in err.value.details()
    finally:
        for s in stacks.values():
            s.close()


def test_a_beam_search_with_images_is_refused(stack):
    """A beam search's later steps send the beams' token ids alone: with images they would lose them."""
    body = {"model": MODEL, "max_tokens": 2, "n": 2, "use_beam_search": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(CAT)}},
                                                      {"type": "text", "text": "what?"}]}]}
    before = len(stack.tokenizer.requests)
    r = httpx.post(stack.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=20)
    assert r.status_code == 400 and "images are not supported with use_beam_search" in r.json()["error"]["message"]
    assert len(stack.tokenizer.requests) == before

"""A vision-language model through the services, end to end: a tiny random LLaVA (CLIP tower at 30x30,
9 placeholder tokens an image) with the default model's tokenizer plus <image> and llava-hf's chat
template, served by every service as a real process. The official `openai` and `anthropic` SDKs send
images as data: URLs, an http URL (a local server) and base64 blocks; the answers equal transformers'
LlavaForConditionalGeneration with LlavaProcessor on the same image and chat (float32, greedy), the
prompt is counted as transformers expands it, and a second request with the same image reuses the
KV cache past the image while another image does not."""

from __future__ import annotations

import base64
import http.server
import threading

import pytest

from service_stack import ask_with_images, data_url, scheduler_stats, wait_until_idle
from tiny_llava import LlavaReference, build_tiny_llava, png, with_random_weights

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def llava(default_model_path, tmp_path_factory):
    return with_random_weights(build_tiny_llava(tmp_path_factory.mktemp("llava-stack"), default_model_path))


@pytest.fixture(scope="module")
def reference(llava):
    return LlavaReference(llava, QUESTION, MAX_TOKENS)


@pytest.fixture(scope="module")
def stack(llava, launch_stack):
    return launch_stack(llava, max_num_seqs=8)


def ask(client, image_url: str):
    return ask_with_images(client, QUESTION, MAX_TOKENS, image_url)


def test_openai_images_answer_as_transformers_and_share_the_cache_only_for_the_same_image(stack, client,
                                                                                         reference):
    first, second = png(1), png(2)
    want, prompt_tokens = reference(first)
    answer = ask(client, data_url(first))
    assert answer.choices[0].message.content == want
    assert answer.usage.prompt_tokens == prompt_tokens
    wait_until_idle(stack)
    hits = scheduler_stats(stack).prefix_cache_hits
    assert ask(client, data_url(first)).choices[0].message.content == want
    wait_until_idle(stack)
    after_same = scheduler_stats(stack).prefix_cache_hits
    assert after_same - hits >= 16  # the blocks past the image too (prompt of ~30 tokens, blocks of 16)
    other = ask(client, data_url(second))
    assert other.choices[0].message.content == reference(second)[0]
    wait_until_idle(stack)
    # the block that holds the image's first placeholder is not served to another image
    assert scheduler_stats(stack).prefix_cache_hits - after_same < after_same - hits


def test_an_image_by_http_url_and_an_anthropic_base64_block(stack, client, reference):
    import anthropic

    image = png(3)
    want = reference(image)[0]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(image)))
            self.end_headers()
            self.wfile.write(image)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/cat.png"
        assert ask(client, url).choices[0].message.content == want
    finally:
        server.shutdown()
    messages = anthropic.Anthropic(base_url=stack.http_url, api_key="unused", max_retries=0).messages.create(
        model=client.models.list().data[0].id, max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0.0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert messages.content[0].text == reference(image, ignore_eos=False)[0]  # (no ignore_eos in this API)


def test_a_bad_image_fails_alone_with_a_400_naming_the_part(stack, client):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as refused:
        ask(client, "data:image/png;base64," + base64.b64encode(b"not a png").decode())
    assert "messages[0].content[0].image_url" in str(refused.value)
    assert ask(client, data_url(png(4))).choices[0].finish_reason == "length"  # the server is fine

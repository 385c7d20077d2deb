"""Qwen2-VL through every service, end to end: a tiny random Qwen2-VL (tests/tiny_qwen2_vl.py: a ViT over
14x14 patches, 2x2 merged, M-RoPE text model) with the default model's tokenizer plus Qwen2-VL's vision
tokens and chat template, served by every service as a real process. The `openai` SDK sends images of
several shapes as data: URLs (each resized to its own dynamic resolution, one placeholder per merged
patch) and two in one message, the `anthropic` SDK a base64 block; the answers equal transformers'
Qwen2VLProcessor + Qwen2VLForConditionalGeneration on the same images and chat (float32, greedy), and
the prompt is counted as transformers expands it."""

from __future__ import annotations

import base64

import pytest

from service_stack import check_image_answers, check_two_images_in_one_message
from tiny_llava import VisionReference, png, with_random_weights
from tiny_qwen2_vl import build_tiny_qwen2_vl, reference_processor

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
QUESTION = "What is in this picture?"
MODEL_CLASS = "Qwen2VLForConditionalGeneration"


@pytest.fixture(scope="module")
def folder(default_model_path, tmp_path_factory):
    folder = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl-stack"), default_model_path)
    return with_random_weights(folder, model_class=MODEL_CLASS)


@pytest.fixture(scope="module")
def reference(folder):
    return VisionReference(folder, QUESTION, MAX_TOKENS, reference_processor(folder), MODEL_CLASS)


@pytest.fixture(scope="module")
def stack(folder, launch_stack):
    return launch_stack(folder, max_num_seqs=4)


def test_openai_images_of_several_shapes_answer_as_transformers(client, reference):
    check_image_answers(client, reference, [png(51, size=(90, 50)), png(52, size=(40, 120)),
                                            png(53, size=(300, 200)), png(54, size=(9, 12))])


def test_two_images_in_one_message(client, reference):
    check_two_images_in_one_message(client, reference, png(55, size=(70, 70)), png(56, size=(120, 40)))


def test_an_anthropic_base64_block(stack, client, reference):
    import anthropic

    image = png(57, size=(64, 48))
    messages = anthropic.Anthropic(base_url=stack.http_url, api_key="unused", max_retries=0).messages.create(
        model=client.models.list().data[0].id, max_tokens=MAX_TOKENS, extra_body={"temperature": 0.0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}},
            {"type": "text", "text": QUESTION}]}])
    want, prompt_tokens = reference(image, ignore_eos=False)
    assert messages.content[0].text == want  # (no ignore_eos in this API)
    assert messages.usage.input_tokens + (messages.usage.cache_read_input_tokens or 0) == prompt_tokens

"""Mistral 3 through every service, end to end: a tiny random Mistral3ForConditionalGeneration
(tests/tiny_pixtral.py: a Pixtral tower over 14x14 patches, 2x2 merged by Mistral3's projector, a Mistral text
model) with the default model's tokenizer plus [IMG] / [IMG_BREAK] / [IMG_END] and a Mistral-style chat
template, served by every service as a real process. The `openai` SDK sends images of several shapes as data:
URLs (each resized so its longest edge fits, each row of merged patches a run of [IMG] ended by [IMG_BREAK],
the last by [IMG_END]) and two in one message; the answers equal transformers' PixtralProcessor +
Mistral3ForConditionalGeneration on the same images and chat (float32, greedy), and the prompt is counted as
transformers expands it."""

from __future__ import annotations

import base64
import io

import pytest

from tiny_llava import VisionReference, png, with_random_weights
from tiny_pixtral import build_tiny_pixtral, reference_processor

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
QUESTION = "What is in this picture?"
MODEL_CLASS = "Mistral3ForConditionalGeneration"


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def folder(default_model_path, tmp_path_factory):
    folder = build_tiny_pixtral(tmp_path_factory.mktemp("mistral3-stack"), default_model_path)
    return with_random_weights(folder, model_class=MODEL_CLASS)


@pytest.fixture(scope="module")
def reference(folder):
    reference = VisionReference(folder, QUESTION, MAX_TOKENS, reference_processor(folder), MODEL_CLASS)
    reference.nested = False  # PixtralProcessor takes a flat list of images
    return reference


@pytest.fixture(scope="module")
def stack(folder, launch_stack):
    return launch_stack(folder, max_num_seqs=4)


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI
    return OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, *images: bytes):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": data_url(image)}}
                                                 for image in images), {"type": "text", "text": QUESTION}]}])


def test_openai_images_of_several_shapes_answer_as_transformers(client, reference):
    for image in (png(51, size=(90, 50)), png(52, size=(40, 120)), png(53, size=(300, 200)), png(54, size=(30, 12))):
        answer = ask(client, image)
        want, prompt_tokens = reference(image)
        assert answer.choices[0].message.content == want
        assert answer.usage.prompt_tokens == prompt_tokens


def test_two_images_in_one_message(client, reference):
    import torch
    from PIL import Image

    first, second = png(55, size=(70, 70)), png(56, size=(120, 40))
    processor = reference.processor
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True)
    inputs = processor(text=prompt, images=[Image.open(io.BytesIO(d)) for d in (first, second)],
                       return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = reference.model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                       do_sample=False)
    length = inputs["input_ids"].shape[1]
    answer = ask(client, first, second)
    assert answer.choices[0].message.content == processor.tokenizer.decode(out[0, length:], skip_special_tokens=True)
    assert answer.usage.prompt_tokens == length

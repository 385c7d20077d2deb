"""`pagedserve serve --mm-processor-kwargs '{"max_pixels": ...}'` through every service: the launcher hands the
flag to the tokenizer and the worker, and a tiny random Qwen2-VL (tests/tiny_qwen2_vl.py, its folder's own
max_pixels 28*28*64) answers images past that bound as transformers' Qwen2VLProcessor built with the same
kwargs does: the same answer, `usage.prompt_tokens` as that processor expands the prompt (more than the
folder's own bound gives). The worker must take images the folder alone would refuse."""

from __future__ import annotations

import io
import json

import pytest

from service_stack import ask_with_images, data_url
from tiny_llava import VisionReference, png, with_random_weights
from tiny_qwen2_vl import PREPROCESSOR, build_tiny_qwen2_vl, reference_processor

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
QUESTION = "What is in this picture?"
MODEL_CLASS = "Qwen2VLForConditionalGeneration"
KWARGS = {"max_pixels": 28 * 28 * 100}


@pytest.fixture(scope="module")
def folder(default_model_path, tmp_path_factory):
    folder = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl-mmk-stack"), default_model_path)
    return with_random_weights(folder, model_class=MODEL_CLASS)


@pytest.fixture(scope="module")
def client(folder, launch_stack):
    from openai import OpenAI
    stack = launch_stack(folder, max_num_seqs=2, mm_processor_kwargs=json.dumps(KWARGS))
    return OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_flag_changes_prompt_tokens_to_the_processors_with_the_same_kwargs(folder, client):
    from PIL import Image

    reference = VisionReference(folder, QUESTION, MAX_TOKENS, reference_processor(folder, {**PREPROCESSOR, **KWARGS}),
                                MODEL_CLASS)
    folder_own = reference_processor(folder)
    for image in (png(61, size=(300, 200)), png(62, size=(150, 400))):  # past the folder's 50176 pixels
        answer = ask_with_images(client, QUESTION, MAX_TOKENS, data_url(image))
        want, prompt_tokens = reference(image)
        own = folder_own(text=reference.prompt, images=Image.open(io.BytesIO(image)), add_special_tokens=False)
        assert prompt_tokens > len(own["input_ids"][0])
        assert (answer.usage.prompt_tokens, answer.choices[0].message.content) == (prompt_tokens, want)

"""Mistral 3 and Pixtral-LLaVA through the offline API, as vLLM's users pass images to them: LLM.generate with
{"prompt": "...[IMG]...", "multi_modal_data": {"image": ...}} (the processor's single [IMG] per image expands to
its span), LLM.chat with image_url parts, two images in one prompt, AsyncLLM.generate; on tiny random models
with the default model's tokenizer plus Pixtral's image tokens (tests/tiny_pixtral.py), each answer equals transformers'
PixtralProcessor + Mistral3ForConditionalGeneration / LlavaForConditionalGeneration on the same images
(float32, greedy), and the prompt is as long as the processor expands it."""

from __future__ import annotations

import pytest

from tiny_llava import VisionReference, async_llm_answer, check_llm_images, png, with_random_weights
from tiny_pixtral import ARCHITECTURES, build_tiny_pixtral, reference_processor

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
QUESTION = "Describe it."


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def model(request, default_model_path, tmp_path_factory):
    """(folder, transformers' answer for one image and QUESTION) of a tiny random model of the family."""
    family = request.param
    folder = build_tiny_pixtral(tmp_path_factory.mktemp(f"{family}-offline"), default_model_path, family)
    with_random_weights(folder, model_class=ARCHITECTURES[family])
    reference = VisionReference(folder, QUESTION, MAX_TOKENS, reference_processor(folder), ARCHITECTURES[family])
    reference.nested = False  # PixtralProcessor takes a flat list of images (Idefics3's takes one per prompt)
    return folder, reference


def test_generate_and_chat_take_images_as_transformers_does(model):
    folder, reference = model
    assert reference.prompt.count("[IMG]") == 1
    # (the smallest: 1 x 2 merged patches; transformers' Mistral3 cannot take an image of one, its features'
    # squeeze(0) drops the row)
    wide, tall, tiny = png(41, size=(90, 50)), png(42, size=(40, 120)), png(43, size=(30, 10))
    check_llm_images(folder, reference, wide, tall, tiny,
                     [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                      {"type": "text", "text": QUESTION}])


def test_async_llm_takes_images(model):
    folder, reference = model
    image = png(44, size=(64, 48))
    assert async_llm_answer(folder, reference, image) == reference(image)[0]

"""Mistral 3 through every service, end to end: a tiny random Mistral3ForConditionalGeneration
(tests/tiny_pixtral.py: a Pixtral tower over 14x14 patches, 2x2 merged by Mistral3's projector, a Mistral text
model) with the default model's tokenizer plus [IMG] / [IMG_BREAK] / [IMG_END] and a Mistral-style chat
template, served by every service as a real process. The `openai` SDK sends images of several shapes as data:
URLs (each resized so its longest edge fits, each row of merged patches a run of [IMG] ended by [IMG_BREAK],
the last by [IMG_END]) and two in one message; the answers equal transformers' PixtralProcessor +
Mistral3ForConditionalGeneration on the same images and chat (float32, greedy), and the prompt is counted as
transformers expands it."""

from __future__ import annotations

import pytest

from service_stack import check_image_answers, check_two_images_in_one_message
from tiny_llava import VisionReference, png, with_random_weights
from tiny_pixtral import build_tiny_pixtral, reference_processor

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
QUESTION = "What is in this picture?"
MODEL_CLASS = "Mistral3ForConditionalGeneration"


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


def test_openai_images_of_several_shapes_answer_as_transformers(client, reference):
    check_image_answers(client, reference, [png(51, size=(90, 50)), png(52, size=(40, 120)),
                                            png(53, size=(300, 200)), png(54, size=(30, 12))])


def test_two_images_in_one_message(client, reference):
    check_two_images_in_one_message(client, reference, png(55, size=(70, 70)), png(56, size=(120, 40)))

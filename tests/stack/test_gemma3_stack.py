"""A Gemma 3 model with images through every service: the tokenizer resizes each image and expands its
<start_of_image> as Gemma3Processor does; the scheduler keeps each image's placeholders in one step (small
steps here: --max-num-batched-tokens 6 under 4 placeholders and the text around them); the worker encodes the
image and attends within it both ways; the `openai` SDK's answer equals transformers' Gemma3Processor +
Gemma3ForConditionalGeneration (float32, greedy). A tiny random model (tests/tiny_gemma3.py) with the default
model's tokenizer plus Gemma 3's image tokens."""

from __future__ import annotations

import pytest

from service_stack import check_image_answers
from tiny_gemma3 import build_tiny_gemma3_folder, reference_processor, solid, with_random_weights
from tiny_llava import VisionReference

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def folder(default_model_path, tmp_path_factory):
    return with_random_weights(build_tiny_gemma3_folder(tmp_path_factory.mktemp("gemma3-stack"), default_model_path))


@pytest.fixture(scope="module")
def stack(folder, launch_stack):
    return launch_stack(folder, max_num_seqs=4, max_num_batched_tokens=6)


def test_openai_images_answer_as_transformers(folder, client):
    reference = VisionReference(folder, QUESTION, MAX_TOKENS, reference_processor(folder),
                                "Gemma3ForConditionalGeneration")
    answers = check_image_answers(client, reference, [solid((0, 0, 255)), solid((255, 255, 255), size=(70, 50)),
                                                      solid((255, 0, 0), size=(9, 12))])
    assert len(set(answers)) > 1  # the images matter

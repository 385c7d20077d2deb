"""An Idefics3 (SmolVLM-style) model through every service: the tokenizer splits an image into tiles
and lays out their rows, columns and global view as Idefics3Processor does; the worker encodes each
tile; the `openai` SDK's answer equals transformers' Idefics3Processor + Idefics3ForConditionalGeneration
(float32, greedy). A tiny random model (tests/tiny_idefics3.py) with the default model's tokenizer."""

from __future__ import annotations

import pytest

from service_stack import check_image_answers
from tiny_idefics3 import build_tiny_idefics3, reference_processor
from tiny_llava import VisionReference, png, with_random_weights

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def folder(default_model_path, tmp_path_factory):
    folder = build_tiny_idefics3(tmp_path_factory.mktemp("idefics3-stack"), default_model_path)
    return with_random_weights(folder, model_class="Idefics3ForConditionalGeneration")


@pytest.fixture(scope="module")
def stack(folder, launch_stack):
    return launch_stack(folder, max_num_seqs=4)


def test_openai_images_split_into_tiles_answer_as_transformers(folder, client):
    reference = VisionReference(folder, QUESTION, MAX_TOKENS, reference_processor(folder),
                                "Idefics3ForConditionalGeneration")
    # 1x2, 2x2, 1 tile
    check_image_answers(client, reference, [png(31, size=(50, 70)), png(32, size=(64, 64)), png(33, size=(12, 9))])

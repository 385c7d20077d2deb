"""Qwen2-VL and Qwen2.5-VL through the offline API, as vLLM's users pass images to them: LLM.generate with
{"prompt": "...<|vision_start|><|image_pad|><|vision_end|>...", "multi_modal_data": {"image": ...}},
LLM.chat with image_url parts, two images in one prompt, AsyncLLM.generate; on tiny random models with the
default model's tokenizer plus Qwen2-VL's vision tokens (tests/tiny_qwen2_vl.py), each answer equals
transformers' processor + Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration on the
same images (float32, greedy), and the prompt is as long as the processor expands it."""

from __future__ import annotations

import pytest

from pagedserve.common.sampling_params import SamplingParams
from tiny_llava import VisionReference, async_llm_answer, check_llm_images, png, with_random_weights
from tiny_qwen2_vl import ARCHITECTURES, build_tiny_qwen2_vl, reference_processor

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
QUESTION = "Describe it."
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def model(request, default_model_path, tmp_path_factory):
    """(folder, transformers' answer for one image and QUESTION) of a tiny random model of the family."""
    family = request.param
    folder = build_tiny_qwen2_vl(tmp_path_factory.mktemp(f"{family}-offline"), default_model_path, family)
    with_random_weights(folder, model_class=ARCHITECTURES[family])
    return folder, VisionReference(folder, QUESTION, MAX_TOKENS, reference_processor(folder), ARCHITECTURES[family])


def test_generate_and_chat_take_images_as_transformers_does(model):
    folder, reference = model
    wide, tall, tiny = png(41, size=(90, 50)), png(42, size=(40, 120)), png(43, size=(10, 10))
    check_llm_images(folder, reference, wide, tall, tiny,
                     [{"type": "image"}, {"type": "image"}, {"type": "text", "text": QUESTION}])


def test_async_llm_takes_images(model):
    folder, reference = model
    image = png(44, size=(64, 48))
    assert async_llm_answer(folder, reference, image) == reference(image)[0]


def test_mm_processor_kwargs_bound_the_images_as_transformers_with_the_same_kwargs(default_model_path,
                                                                                   tmp_path_factory):
    """LLM(model, mm_processor_kwargs={"max_pixels": ...}) above and below the folder's own max_pixels (28*28*64):
    the answers and prompt lengths of transformers' processor built with the same kwargs. Above it, the worker
    must take the images past the folder's bound (the override reaches both sides)."""
    from pagedserve import LLM
    from tiny_qwen2_vl import PREPROCESSOR

    folder = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl-mmk"), default_model_path)
    with_random_weights(folder, model_class=ARCHITECTURES["qwen2_vl"])
    images = [png(45, size=(300, 200)), png(46, size=(150, 400))]  # past the folder's 50176 pixels
    lengths = {}
    for max_pixels in (28 * 28 * 100, 28 * 28 * 16):
        kwargs = {"max_pixels": max_pixels}
        reference = VisionReference(folder, QUESTION, MAX_TOKENS, reference_processor(folder, {**PREPROCESSOR,
                                                                                               **kwargs}),
                                    ARCHITECTURES["qwen2_vl"])
        with LLM(model=str(folder), dtype="float32", kv_cache_memory="64MiB", mm_processor_kwargs=kwargs) as llm:
            outs = llm.generate([{"prompt": reference.prompt, "multi_modal_data": {"image": image}}
                                 for image in images], GREEDY)
        want = [reference(image) for image in images]
        assert [(o.outputs[0].text, len(o.prompt_token_ids)) for o in outs] == want
        lengths[max_pixels] = [n for _, n in want]
    folder_own = VisionReference(folder, QUESTION, MAX_TOKENS, reference_processor(folder), ARCHITECTURES["qwen2_vl"])
    own = [folder_own(image)[1] for image in images]
    assert all(up > mid > down for up, mid, down in zip(lengths[28 * 28 * 100], own, lengths[28 * 28 * 16]))

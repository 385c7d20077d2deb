"""Qwen2-VL and Qwen2.5-VL through the offline API, as vLLM's users pass images to them: LLM.generate with
{"prompt": "...<|vision_start|><|image_pad|><|vision_end|>...", "multi_modal_data": {"image": ...}},
LLM.chat with image_url parts, two images in one prompt, AsyncLLM.generate; on tiny random models with the
default model's tokenizer plus Qwen2-VL's vision tokens (tests/tiny_qwen2_vl.py), each answer equals
transformers' processor + Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration on the
same images (float32, greedy), and the prompt is as long as the processor expands it."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest

from pagedserve.common.sampling_params import SamplingParams
from tiny_llava import VisionReference, png, with_random_weights
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


def two_image_reference(reference: VisionReference, images: list[bytes]) -> tuple[str, str, int]:
    """(the chat template's prompt for two images then QUESTION, transformers' greedy answer, its length
    in tokens) on the reference's processor and model."""
    import torch
    from PIL import Image

    processor = reference.processor
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True)
    inputs = processor(text=prompt, images=[Image.open(io.BytesIO(d)) for d in images], return_tensors="pt",
                       add_special_tokens=False)
    with torch.no_grad():
        out = reference.model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                       do_sample=False)
    length = inputs["input_ids"].shape[1]
    return prompt, processor.tokenizer.decode(out[0, length:], skip_special_tokens=True), length


def test_generate_and_chat_take_images_as_transformers_does(model):
    from pagedserve import LLM

    folder, reference = model
    wide, tall, tiny = png(41, size=(90, 50)), png(42, size=(40, 120)), png(43, size=(10, 10))
    with LLM(model=str(folder), dtype="float32", kv_cache_memory="64MiB") as llm:
        outs = llm.generate([{"prompt": reference.prompt, "multi_modal_data": {"image": image}}
                             for image in (wide, tall, tiny)], GREEDY)
        url = "data:image/png;base64," + base64.b64encode(wide).decode()
        [chat] = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                        {"type": "text", "text": QUESTION}]}], GREEDY)
        prompt, want, length = two_image_reference(reference, [tall, wide])
        [both] = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [tall, wide]}}, GREEDY)
    assert [o.outputs[0].text for o in outs] == [reference(image)[0] for image in (wide, tall, tiny)]
    assert [len(o.prompt_token_ids) for o in outs] == [reference(image)[1] for image in (wide, tall, tiny)]
    assert chat.outputs[0].text == reference(wide)[0]
    assert (both.outputs[0].text, len(both.prompt_token_ids)) == (want, length)


def test_async_llm_takes_images(model):
    from pagedserve import AsyncLLM

    folder, reference = model
    image = png(44, size=(64, 48))

    async def main():
        async with AsyncLLM(model=str(folder), dtype="float32", kv_cache_memory="64MiB") as engine:
            outs = [out async for out in engine.generate(
                {"prompt": reference.prompt, "multi_modal_data": {"image": image}}, GREEDY)]
            return outs[-1].outputs[0].text

    assert asyncio.run(main()) == reference(image)[0]


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

"""Mistral 3 and Pixtral-LLaVA through the offline API, as vLLM's users pass images to them: LLM.generate with
{"prompt": "...[IMG]...", "multi_modal_data": {"image": ...}} (the processor's single [IMG] per image expands to
its span), LLM.chat with image_url parts, two images in one prompt, AsyncLLM.generate; on tiny random models
with the default model's tokenizer plus Pixtral's image tokens (tests/tiny_pixtral.py), each answer equals transformers'
PixtralProcessor + Mistral3ForConditionalGeneration / LlavaForConditionalGeneration on the same images
(float32, greedy), and the prompt is as long as the processor expands it."""

from __future__ import annotations

import base64
import io

import pytest

from pagedserve.common.sampling_params import SamplingParams
from tiny_llava import VisionReference, png, with_random_weights
from tiny_pixtral import ARCHITECTURES, build_tiny_pixtral, reference_processor

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
QUESTION = "Describe it."
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def model(request, default_model_path, tmp_path_factory):
    """(folder, transformers' answer for one image and QUESTION) of a tiny random model of the family."""
    family = request.param
    folder = build_tiny_pixtral(tmp_path_factory.mktemp(f"{family}-offline"), default_model_path, family)
    with_random_weights(folder, model_class=ARCHITECTURES[family])
    reference = VisionReference(folder, QUESTION, MAX_TOKENS, reference_processor(folder), ARCHITECTURES[family])
    reference.nested = False  # PixtralProcessor takes a flat list of images (Idefics3's takes one per prompt)
    return folder, reference


def two_image_reference(reference: VisionReference, images: list[bytes]) -> tuple[str, str, int]:
    """(the chat template's prompt for two images then QUESTION, transformers' greedy answer, its length)."""
    import torch
    from PIL import Image

    processor = reference.processor
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                         {"type": "text", "text": QUESTION}]}]
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
    assert reference.prompt.count("[IMG]") == 1
    # (the smallest: 1 x 2 merged patches; transformers' Mistral3 cannot take an image of one, its features'
    # squeeze(0) drops the row)
    wide, tall, tiny = png(41, size=(90, 50)), png(42, size=(40, 120)), png(43, size=(30, 10))
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
    import asyncio

    from pagedserve import AsyncLLM

    folder, reference = model
    image = png(44, size=(64, 48))

    async def main():
        async with AsyncLLM(model=str(folder), dtype="float32", kv_cache_memory="64MiB") as engine:
            outs = [out async for out in engine.generate(
                {"prompt": reference.prompt, "multi_modal_data": {"image": image}}, GREEDY)]
            return outs[-1].outputs[0].text

    assert asyncio.run(main()) == reference(image)[0]

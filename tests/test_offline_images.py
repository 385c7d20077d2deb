"""Images through the offline API, as vLLM's users pass them: LLM.generate with {"prompt": ...,
"multi_modal_data": {"image": ...}}, LLM.chat with image_url parts, AsyncLLM.generate; on a tiny random
LLaVA with the default model's tokenizer plus <image> (tests/tiny_llava.py), each answer equals
transformers' LlavaProcessor + LlavaForConditionalGeneration on the same image (float32, greedy)."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
from PIL import Image

from pagedserve.common.sampling_params import SamplingParams
from tiny_llava import LlavaReference, VisionReference, build_tiny_llava, png, with_random_weights

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
QUESTION = "Describe it."
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(default_model_path, tmp_path_factory):
    return with_random_weights(build_tiny_llava(tmp_path_factory.mktemp("llava-offline"), default_model_path))


@pytest.fixture(scope="module")
def reference(folder):
    return LlavaReference(folder, QUESTION, MAX_TOKENS)


@pytest.fixture(scope="module")
def llm(folder):
    from pagedserve import LLM
    with LLM(model=str(folder), dtype="float32", kv_cache_memory="64MiB") as engine:
        yield engine


def test_generate_and_chat_take_images_as_vllm_does(llm, reference):
    first, second = png(11), png(12, size=(20, 50))
    outs = llm.generate([{"prompt": reference.prompt, "multi_modal_data": {"image": Image.open(io.BytesIO(first))}},
                         {"prompt": reference.prompt, "multi_modal_data": {"image": second}}], GREEDY)
    assert [o.outputs[0].text for o in outs] == [reference(first)[0], reference(second)[0]]
    assert len(outs[0].prompt_token_ids) == reference(first)[1]
    url = "data:image/png;base64," + base64.b64encode(first).decode()
    [chat] = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                    {"type": "text", "text": QUESTION}]}], GREEDY)
    assert chat.outputs[0].text == reference(first)[0]


def test_images_that_do_not_match_the_prompt_are_refused_naming_the_prompt(llm, reference):
    with pytest.raises(ValueError, match=r"prompts\[0\]: the prompt has 1 image tokens .* for 2"):
        llm.generate({"prompt": reference.prompt, "multi_modal_data": {"image": [png(1), png(2)]}}, GREEDY)
    with pytest.raises(ValueError, match="multi_modal_data takes \"image\" only"):
        llm.generate({"prompt": reference.prompt, "multi_modal_data": {"audio": b""}}, GREEDY)


def test_async_llm_takes_images(folder, reference):
    from pagedserve import AsyncLLM
    image = png(13)

    async def main():
        async with AsyncLLM(model=str(folder), dtype="float32", kv_cache_memory="64MiB") as engine:
            outs = [out async for out in engine.generate(
                {"prompt": reference.prompt, "multi_modal_data": {"image": image}}, GREEDY)]
            return outs[-1].outputs[0].text

    assert asyncio.run(main()) == reference(image)[0]


@pytest.fixture(scope="module")
def smolvlm(default_model_path, tmp_path_factory):
    """A tiny Idefics3 (SmolVLM-style: SmolLM2's tokenizer, 32x32 tiles, 4 rows a tile, images split into
    tiles up to 64 pixels a side plus the global view) with random weights, and transformers' answer."""
    from tiny_idefics3 import build_tiny_idefics3, reference_processor

    folder = build_tiny_idefics3(tmp_path_factory.mktemp("idefics3-offline"), default_model_path)
    with_random_weights(folder, model_class="Idefics3ForConditionalGeneration")
    return folder, VisionReference(folder, QUESTION, MAX_TOKENS, reference_processor(folder),
                                   "Idefics3ForConditionalGeneration")


def test_an_idefics3_model_splits_images_into_tiles_as_transformers_does(smolvlm):
    from pagedserve import LLM
    folder, reference = smolvlm
    wide, small = png(21, size=(90, 40)), png(22, size=(20, 30))  # 2x1 tiles + the global view; one tile
    with LLM(model=str(folder), dtype="float32", kv_cache_memory="64MiB") as llm:
        outs = llm.generate([{"prompt": reference.prompt, "multi_modal_data": {"image": wide}},
                             {"prompt": reference.prompt, "multi_modal_data": {"image": small}}], GREEDY)
        url = "data:image/png;base64," + base64.b64encode(wide).decode()
        [chat] = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                        {"type": "text", "text": QUESTION}]}], GREEDY)
    assert [o.outputs[0].text for o in outs] == [reference(wide)[0], reference(small)[0]]
    assert [len(o.prompt_token_ids) for o in outs] == [reference(wide)[1], reference(small)[1]]
    assert chat.outputs[0].text == reference(wide)[0]


def test_an_idefics3_model_with_its_tokenizer_elsewhere(smolvlm, tmp_path):
    """LLM(model=..., tokenizer=...): the image layout's tokens are read from the tokenizer given."""
    import shutil

    from pagedserve import LLM
    folder, reference = smolvlm
    weights = tmp_path / "weights"
    weights.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors", "preprocessor_config.json",
                 "processor_config.json"):
        shutil.copy(folder / name, weights / name)
    image = png(23, size=(40, 90))
    with LLM(model=str(weights), tokenizer=str(folder), dtype="float32", kv_cache_memory="64MiB") as llm:
        [out] = llm.generate({"prompt": reference.prompt, "multi_modal_data": {"image": image}}, GREEDY)
    assert out.outputs[0].text == reference(image)[0]

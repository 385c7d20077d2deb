"""Gemma 3's images through the offline API as vLLM's users pass them: LLM.generate with {"prompt": text with
<start_of_image>, "multi_modal_data": {"image": ...}} and LLM.chat with image_url parts, on a tiny random
Gemma3ForConditionalGeneration with the default model's tokenizer plus Gemma 3's image tokens
(tests/tiny_gemma3.py); each answer equals transformers' Gemma3Processor + Gemma3ForConditionalGeneration
(float32, greedy, its bidirectional image mask from the processor's token_type_ids)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from pagedserve.common.sampling_params import SamplingParams
from tiny_gemma3 import build_tiny_gemma3_folder, reference_processor, solid, with_random_weights
from tiny_llava import VisionReference

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
QUESTION = "Describe it."
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3(default_model_path, tmp_path_factory):
    folder = build_tiny_gemma3_folder(tmp_path_factory.mktemp("gemma3-offline"), default_model_path)
    with_random_weights(folder)
    return folder, VisionReference(folder, QUESTION, MAX_TOKENS, reference_processor(folder),
                                   "Gemma3ForConditionalGeneration")


def test_generate_and_chat_take_images_as_vllm_does(gemma3):
    from pagedserve import LLM
    folder, reference = gemma3
    assert reference.prompt.count("<start_of_image>") == 1
    first, second = solid((0, 0, 255)), solid((255, 255, 255), size=(20, 50))
    with LLM(model=str(folder), dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=8) as llm:
        outs = llm.generate([{"prompt": reference.prompt, "multi_modal_data": {"image": Image.open(io.BytesIO(first))}},
                             {"prompt": reference.prompt, "multi_modal_data": {"image": second}}], GREEDY)
        url = "data:image/png;base64," + base64.b64encode(first).decode()
        [chat] = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                        {"type": "text", "text": QUESTION}]}], GREEDY)
        with pytest.raises(ValueError, match=r"prompts\[0\]: the prompt has 1 image tokens .* for 2"):
            llm.generate({"prompt": reference.prompt, "multi_modal_data": {"image": [first, second]}}, GREEDY)
    assert [o.outputs[0].text for o in outs] == [reference(first)[0], reference(second)[0]]
    assert outs[0].outputs[0].text != outs[1].outputs[0].text  # the image matters
    assert [len(o.prompt_token_ids) for o in outs] == [reference(first)[1], reference(second)[1]]
    assert chat.outputs[0].text == reference(first)[0]

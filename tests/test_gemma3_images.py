"""Gemma 3's image front end (model_files/gemma3_images.py through image_processing.py) against transformers'
Gemma3Processor with its PIL image processor on a tiny folder (tests/tiny_gemma3.py, the default model's
tokenizer with Gemma 3's image tokens): the expanded input_ids equal the processor's (its "\\n\\n" around each
image merged with neighbouring newlines as the tokenizer merges them), each image's bytes equal its resized
pixels before rescale, for images of many shapes and modes, one or two images, at the start or the end, in a
chat; the tokenizer service and the offline path give the same; folders that disagree are refused."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from pagedserve.common.multimodal import image_from_proto
from pagedserve.model_files import image_processing as ip
from pagedserve.model_files.prompt_images import chat_prompt, prompt_images
from pagedserve.model_files.tokenizer_files import load_tokenizer
from tiny_gemma3 import IMAGE_SIZE, MM_TOKENS, PREPROCESSOR, build_tiny_gemma3_folder, reference_processor


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from pagedserve.model_files.default_model import resolve_model
    return build_tiny_gemma3_folder(tmp_path_factory.mktemp("tiny-gemma3"), resolve_model(None))


def images() -> list[tuple[str, Image.Image]]:
    rng = np.random.default_rng(0)

    def rgb(width, height):
        return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return [("small", rgb(19, 7)), ("exact", rgb(IMAGE_SIZE, IMAGE_SIZE)), ("wide", rgb(150, 40)),
            ("tall", rgb(30, 121)), ("big", rgb(300, 200)),
            ("rgba", Image.fromarray(rng.integers(0, 256, (41, 29, 4), dtype=np.uint8), "RGBA")),
            ("gray", Image.fromarray(rng.integers(0, 256, (33, 71), dtype=np.uint8), "L"))]


def encoded(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def their_pixels(processor, pics) -> list[bytes]:
    """The image processor's resized images, before rescale and normalize, as RGB uint8 bytes."""
    values = processor.image_processor(pics, do_rescale=False, do_normalize=False, return_tensors="np").pixel_values
    assert np.array_equal(values, np.rint(values))
    return [frame.transpose(1, 2, 0).astype(np.uint8).tobytes() for frame in values]


TEXTS = ["Look:\n<start_of_image>What is it?", "<start_of_image>", "a<start_of_image><start_of_image>\n\nb",
         "x\n\n\n<start_of_image>\ny", "Two: <start_of_image> and\n<start_of_image>"]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_pixels_equal_gemma3_processor(folder, text):
    config = ip.image_config(folder)
    processor = reference_processor(folder)
    tokenizer = processor.tokenizer
    count = text.count("<start_of_image>")
    for k in range(0, len(images()) - count + 1, 2):
        pics = [image for _, image in images()[k:k + count]]
        theirs = processor(text=text, images=pics, return_tensors="np", add_special_tokens=False)
        ids, placed = ip.expand_placeholders(config, tokenizer.encode(text, add_special_tokens=False),
                                             [ip.process_image(config, encoded(p)) for p in pics])
        assert ids == [int(t) for t in theirs["input_ids"][0]], (text, k)
        assert [p.data for p in placed] == their_pixels(processor, pics)
        types = [int(t) for t in theirs["token_type_ids"][0]]
        assert [i for i, t in enumerate(types) if t] == [p.offset + j for p in placed for j in range(MM_TOKENS)]
        assert all((p.length, p.height, p.width) == (MM_TOKENS, IMAGE_SIZE, IMAGE_SIZE) for p in placed)


def test_every_shape_and_mode(folder):
    config = ip.image_config(folder)
    processor = reference_processor(folder)
    for name, image in images():
        assert ip.process_image(config, encoded(image))[2] == their_pixels(processor, [image])[0], name


def test_a_chat_and_the_offline_prompt(folder):
    """LLM.chat's path (OpenAI image_url parts through the chat template) and LLM.generate's
    ({"prompt": text with <start_of_image>, "multi_modal_data": ...}) give the processor's ids."""
    tokenizer = load_tokenizer(folder)
    config = ip.image_config(folder, tokenizer)
    processor = reference_processor(folder)
    pics = [images()[2][1], images()[4][1]]
    data = [encoded(p) for p in pics]
    text = processor.apply_chat_template(
        [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
         {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                      {"type": "text", "text": "What is in these?"}]}], add_generation_prompt=True)
    assert text.count("<start_of_image>") == 2 and text.startswith(tokenizer.bos_token or "")
    theirs = processor(text=text, images=pics, return_tensors="np", add_special_tokens=False)
    want = [int(t) for t in theirs["input_ids"][0]]
    urls = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(d).decode()}}
            for d in data]
    ids, placed, rendered = chat_prompt(tokenizer, config, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [urls[0], {"type": "text", "text": "and"}, urls[1],
                                     {"type": "text", "text": "What is in these?"}]}], add_generation_prompt=True)
    assert rendered == text and ids == want
    assert [p.data for p in placed] == their_pixels(processor, pics)
    assert prompt_images(config, tokenizer.encode(text, add_special_tokens=False), data) == (want, placed)


def test_the_tokenizer_service_expands_as_the_processor(folder):
    from pagedserve.v1 import generate_pb2
    from test_tokenizer_images import chat_with_images
    from test_tokenizer_service import collect, start_stack, streamer

    tokenizer = load_tokenizer(folder)
    config = ip.image_config(folder, tokenizer)
    processor = reference_processor(folder)
    pics = [images()[0][1], images()[5][1]]
    data = [encoded(p) for p in pics]
    text = processor.apply_chat_template(
        [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
         {"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                      {"type": "text", "text": "What is in these?"}]}], add_generation_prompt=True)
    want = [int(t) for t in processor(text=text, images=pics, return_tensors="np",
                                      add_special_tokens=False)["input_ids"][0]]

    async def main():
        stub, fake, _, _, stop = await start_stack(tokenizer, [streamer([5, 6])], images=config)
        try:
            res = await collect(stub, chat_with_images(*data))
            sent = fake.requests[0]
            got = [image_from_proto(m) for m in sent.images]
            assert [g.data for g in got] == their_pixels(processor, pics)
            ids = list(sent.prompt_token_ids)
            assert ids == want
            assert all(ids[g.offset - 1:g.end + 1] == [config.image_token_id] + [config.soft_token_id] * MM_TOKENS
                       + [config.eoi_token_id] for g in got)
            assert res[0].accepted and res[0].usage.prompt_tokens == len(ids)
            assert (await stub.GetModelInfo(generate_pb2.ModelInfoRequest())).takes_images
        finally:
            await stop()
    asyncio.run(main())


def test_folders_that_disagree_are_refused(folder, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    for pre, match in (({**PREPROCESSOR, "do_pan_and_scan": True}, "do_pan_and_scan is not supported"),
                       ({**PREPROCESSOR, "size": {"height": 64, "width": 64}}, "the vision tower takes 56x56")):
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(pre))
        with pytest.raises(ValueError, match=match):
            ip.image_config(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    assert ip.image_config(tmp_path).tokens_per_image == MM_TOKENS
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": 256}))
    with pytest.raises(ValueError, match="image_seq_length 256 is not the model's mm_tokens_per_image 4"):
        ip.image_config(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": MM_TOKENS}))
    (tmp_path / "config.json").write_text(json.dumps({**config, "boi_token_index": 5}))
    with pytest.raises(ValueError, match="not config.json's token 5"):
        ip.image_config(tmp_path)
    one = ip.process_image(ip.image_config(folder), encoded(images()[0][1]))
    with pytest.raises(ValueError, match="1 image tokens .* for 2 images"):
        ip.expand_placeholders(ip.image_config(folder), [1, ip.image_config(folder).image_token_id, 2], [one, one])

"""Pixtral's and Mistral 3's image front end (model_files/pixtral_images.py through image_processing.py)
against transformers' PixtralImageProcessorPil and PixtralProcessor on tiny folders (tests/tiny_pixtral.py):
each image's resized RGB equals the processor's pixel_values (before rescale and normalize, padding cut off),
its size equals image_sizes, the expanded input_ids (rows of [IMG] with [IMG_BREAK] / [IMG_END]) equal the
processor's for the chat template's prompt and vLLM's raw prompt shape; the tokenizer service, /tokenize and
the offline path give the same; the worker's exact span check (image_problem) takes what the front end makes
and refuses spans that differ."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import numpy as np
import pytest
from PIL import Image

from pagedserve.common.multimodal import ImageInput
from pagedserve.common.pixtral_config import span_tokens
from pagedserve.common.vision_config import image_problem, vision_parts
from pagedserve.model_files import image_processing as ip
from pagedserve.model_files.prompt_images import prompt_images
from pagedserve.model_files.tokenizer_files import load_tokenizer
from image_checks import chat, encoded, rgb, shaped_images, check_tokenizer_service
from tiny_pixtral import PATCH, MERGE, build_tiny_pixtral, preprocessor, reference_processor

FAMILIES = ("mistral3", "llava")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from pagedserve.model_files.default_model import resolve_model
    model = resolve_model(None)
    return {family: build_tiny_pixtral(tmp_path_factory.mktemp(f"tiny-{family}"), model, family)
            for family in FAMILIES}


def images() -> list[tuple[str, Image.Image]]:
    """(name, image) of many sizes and aspect ratios (smaller and larger than longest_edge 112), and modes."""
    shapes = [(1, 1), (19, 7), (28, 28), (56, 84), (90, 50), (37, 53), (112, 112), (113, 112), (200, 30), (30, 500),
              (640, 480), (480, 640), (1000, 30), (333, 1001), (2048, 1536), (129, 17)]
    return shaped_images(shapes)


def worker_vision(folder) -> dict:
    return vision_parts(json.loads((folder / "config.json").read_text()))[1]


def their_images(theirs) -> list[bytes]:
    """pixel_values [images, 3, H, W] (padded to the batch's largest) with rescale and normalize off: each
    image's RGB uint8 bytes at its image_sizes."""
    out = []
    for pixels, (h, w) in zip(theirs["pixel_values"], theirs["image_sizes"]):
        hwc = pixels[:, :h, :w].transpose(1, 2, 0)
        assert np.array_equal(hwc, np.round(hwc)) and hwc.min() >= 0 and hwc.max() <= 255
        out.append(hwc.astype(np.uint8).tobytes())
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_pixels_equal_the_image_processor_on_many_shapes(folders, family):
    folder = folders[family]
    config = ip.image_config(folder)
    factor = PATCH[family] * MERGE[family]
    processor = reference_processor(folder).image_processor
    vision = worker_vision(folder)
    for name, image in images():
        for fmt in ("PNG", "WEBP", "GIF") if name == "90x50" else ("PNG",):
            data = encoded(image, fmt)
            theirs = processor(Image.open(io.BytesIO(data)), do_rescale=False, do_normalize=False,
                               patch_size={"height": factor, "width": factor}, return_tensors="np")
            height, width, pixels = ip.process_image(config, data)
            assert [height, width] == [int(v) for v in theirs["image_sizes"][0]], (name, fmt)
            assert pixels == their_images(theirs)[0], (name, fmt)
            ids, placed = ip.expand_placeholders(config, [7, config.image_token_id, 8], [(height, width, pixels)])
            rows, cols = height // factor, width // factor
            assert len(ids) == 2 + rows * (cols + 1) and placed[0].length == rows * (cols + 1)
            assert image_problem(placed, ids, vision) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_equal_the_processor_for_the_chat_templates_prompt(folders, family):
    folder = folders[family]
    config = ip.image_config(folder)
    processor = reference_processor(folder)
    tokenizer = processor.tokenizer
    text = processor.apply_chat_template(chat(2), add_generation_prompt=True)
    assert text.endswith("[INST][IMG][IMG]What is in these?[/INST]")
    vision = worker_vision(folder)
    pairs = [(rgb(90, 50, 1), rgb(19, 7, 2)), (rgb(640, 480, 3), rgb(28, 28, 4)), (rgb(333, 1001, 5), rgb(1, 1, 6))]
    for pics in pairs:
        theirs = processor(text=text, images=list(pics), return_tensors="np", add_special_tokens=False,
                           do_rescale=False, do_normalize=False)
        ids, placed = ip.expand_placeholders(config, tokenizer.encode(text, add_special_tokens=False),
                                             [ip.process_image(config, p) for p in pics])
        assert ids == [int(t) for t in theirs["input_ids"][0]]
        assert [p.data for p in placed] == their_images(theirs)
        assert [[p.height, p.width] for p in placed] == [[int(v) for v in s] for s in theirs["image_sizes"]]
        for p in placed:  # the span: from the first [IMG] through [IMG_END]
            rows, cols = p.height // config.factor, p.width // config.factor
            assert ids[p.offset:p.end] == span_tokens(rows, cols, config.image_token_id,
                                                      config.image_break_token_id, config.image_end_token_id)
        assert image_problem(placed, ids, vision) is None
        # vLLM's raw prompt shape (LLM.generate's multi_modal_data: one [IMG] per image) gives the same
        assert prompt_images(config, tokenizer.encode(text, add_special_tokens=False), list(pics)) == (ids, placed)


def test_the_workers_span_check_is_exact(folders):
    folder = folders["mistral3"]
    config, vision = ip.image_config(folder), worker_vision(folder)
    ids, [image] = ip.expand_placeholders(config, [7, config.image_token_id, 8],
                                          [ip.process_image(config, rgb(90, 50))])  # 56x112: 2 rows of 4
    assert ids[1:11] == [config.image_token_id] * 4 + [config.image_break_token_id] + \
        [config.image_token_id] * 4 + [config.image_end_token_id]
    assert image_problem([image], ids, vision) is None
    moved = list(ids)
    moved[5], moved[4] = config.image_token_id, config.image_break_token_id
    assert "break" in image_problem([image], moved, vision)
    no_end = ids[:10] + [config.image_break_token_id] + ids[11:]
    assert "end" in image_problem([image], no_end, vision)
    short = dataclasses.replace(image, length=image.length - 1)
    assert "spans 10" in image_problem([short], ids, vision)
    odd = ImageInput(1, 10, 56, 100, bytes(56 * 100 * 3))
    assert "multiples of 28, at most 112" in image_problem([odd], ids, vision)
    big = ImageInput(1, 30, 140, 56, bytes(140 * 56 * 3))
    assert "at most 112" in image_problem([big], ids + [0] * 20, vision)


def test_folders_that_disagree_with_the_vision_tower_or_the_tokenizer_are_refused(folders, tmp_path):
    folder = folders["mistral3"]
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "processor_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    config = json.loads((folder / "config.json").read_text())
    proc = json.loads((folder / "processor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor("mistral3", size={"longest_edge": 200})))
    with pytest.raises(ValueError, match="sides of up to 224: the vision tower takes at most 112"):
        ip.image_config(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor("mistral3", size={"shortest_edge": 9})))
    with pytest.raises(ValueError, match="size must be"):
        ip.image_config(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor("mistral3")))
    for change, message in (({"patch_size": 16}, "patch_size 16 is not the vision tower's 14"),
                            ({"spatial_merge_size": 1}, "spatial_merge_size 1 is not the vision tower's 2")):
        (tmp_path / "processor_config.json").write_text(json.dumps({**proc, **change}))
        with pytest.raises(ValueError, match=message):
            ip.image_config(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps(proc))
    for key in ("image_token_index", "image_break_token_id", "image_end_token_id"):
        (tmp_path / "config.json").write_text(json.dumps({**config, key: 5}))
        with pytest.raises(ValueError, match=r"tokenizer makes \[IMG(_BREAK|_END)?\] \[\d+\], not the model's id 5"):
            ip.image_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    from pagedserve.model_files.default_model import resolve_model
    with pytest.raises(ValueError, match=r"the tokenizer makes \[IMG\] \["):  # a tokenizer without it
        ip.image_config(tmp_path, load_tokenizer(resolve_model(None)))


def test_counts_and_refusals(folders):
    config = ip.image_config(folders["mistral3"])
    one = ip.process_image(config, encoded(rgb(60, 40)))
    assert one[:2] == (56, 84)  # sides rounded up to multiples of 28
    with pytest.raises(ValueError, match="1 image tokens .* for 2 images"):
        ip.expand_placeholders(config, [1, config.image_token_id, 2], [one, one])
    with pytest.raises(ValueError, match="aspect ratio is too extreme"):
        ip.process_image(config, encoded(rgb(3000, 2)))  # the short side floors to 0
    with pytest.raises(ValueError, match="could not be decoded"):
        ip.process_image(config, encoded(rgb(60, 40))[:60])
    fixed = dataclasses.replace(config, do_resize=False)
    with pytest.raises(ValueError, match=r"multiples of 28, at most 112 \(do_resize is false\)"):
        ip.process_image(fixed, encoded(rgb(60, 40)))
    assert ip.process_image(fixed, encoded(rgb(84, 56)))[:2] == (56, 84)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tokenizer_service_sends_the_processors_prompt_and_images(folders, family):
    """A chat with two images through the tokenizer service (image_checks.check_tokenizer_service): each
    ImageInput sent covers its whole span, its pixels the processor's, and the worker's span check takes them."""
    folder = folders[family]

    def check_images(theirs, want, got, config):
        assert [g.data for g in got] == their_images(theirs)
        assert image_problem(got, want, worker_vision(folder)) is None
    check_tokenizer_service(folder, reference_processor(folder), check_images)


def test_the_offline_apis_encoding_takes_vllms_pixtral_prompt_shape(folders):
    """LLM.generate's {"prompt": "...[IMG]...", "multi_modal_data": {"image": ...}} (an image alone or a list;
    bytes or PIL) and LLM.chat's image parts encode as the processor does (engine/llm.py)."""
    from pagedserve.engine.llm import encode_chat, encode_with_images

    folder = folders["llava"]
    tokenizer = load_tokenizer(folder)
    config = ip.image_config(folder, tokenizer)
    processor = reference_processor(folder)
    prompt = processor.apply_chat_template(chat(1, "Describe it."), add_generation_prompt=True)
    image = rgb(120, 70, 21)
    theirs = processor(text=prompt, images=[image], return_tensors="np", do_rescale=False, do_normalize=False,
                       add_special_tokens=False)
    want = [int(t) for t in theirs["input_ids"][0]]
    for value in (image, encoded(image), [encoded(image)]):
        text, ids, placed = encode_with_images(tokenizer, config, {"prompt": prompt,
                                                                   "multi_modal_data": {"image": value}}, "prompts[0]")
        assert (text, ids) == (prompt, want) and [p.data for p in placed] == their_images(theirs)
    with pytest.raises(ValueError, match=r"prompts\[1\]: the prompt has 1 image tokens .* for 2 images"):
        encode_with_images(tokenizer, config, {"prompt": prompt, "multi_modal_data": {"image": [image, image]}},
                           "prompts[1]")
    url = "data:image/png;base64," + base64.b64encode(encoded(image)).decode()
    ids, text, placed = encode_chat(tokenizer, config, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]}])
    assert (ids, text) == (want, prompt) and len(placed) == 1

"""Qwen2-VL / Qwen2.5-VL's image front end (model_files/qwen2_vl_images.py through image_processing.py)
against transformers' Qwen2VLImageProcessorPil and Qwen2VLProcessor / Qwen2_5_VLProcessor on tiny
folders (tests/tiny_qwen2_vl.py): each image's resized RGB equals the processor's pixel_values
un-patchified (before rescale and normalize), its grid equals image_grid_thw, the expanded input_ids
equal the processor's for the chat template's prompt; the tokenizer service, /tokenize and the offline
path give the same (tests/test_qwen_vl_gateway.py: the gateway in front of them)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from pagedserve.common.vision_config import image_problem, vision_parts
from pagedserve.model_files import image_processing as ip
from pagedserve.model_files.prompt_images import chat_prompt, prompt_images
from pagedserve.model_files.qwen2_vl_images import smart_resize
from pagedserve.model_files.tokenizer_files import load_tokenizer
from image_checks import chat, encoded, rgb, shaped_images, check_tokenizer_service
from tiny_qwen2_vl import PREPROCESSOR, build_tiny_qwen2_vl, reference_processor

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
# transformers 5's layout of the pixel range, another resample, no resize (images already multiples of 28)
SIZED = {**{k: v for k, v in PREPROCESSOR.items() if k not in ("min_pixels", "max_pixels")},
         "size": {"shortest_edge": 28 * 28 * 8, "longest_edge": 28 * 28 * 30}}
PRE = {"hub": PREPROCESSOR, "size": SIZED, "bilinear": {**PREPROCESSOR, "resample": 2},
       "no-resize": {**PREPROCESSOR, "do_resize": False}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from pagedserve.model_files.default_model import resolve_model
    model = resolve_model(None)
    return {family: build_tiny_qwen2_vl(tmp_path_factory.mktemp(f"tiny-{family}"), model, family)
            for family in FAMILIES}


def images() -> list[tuple[str, Image.Image]]:
    """(name, image) of many sizes and aspect ratios, and the modes convert_rgb handles."""
    shapes = [(1, 1), (19, 7), (28, 28), (56, 84), (90, 50), (37, 53), (200, 3), (3, 500), (640, 480), (480, 640),
              (1000, 30), (333, 1001), (2048, 1536), (4000, 100), (3000, 20)]
    return shaped_images(shapes)


def their_images(pixel_values: np.ndarray, grids: np.ndarray, merge: int = 2, patch: int = 14) -> list[bytes]:
    """pixel_values (patches of every image, rows of C * T * patch^2 in the merged-window order of
    Qwen2VLImageProcessor.patchify), un-normalized with do_rescale/do_normalize off: each image's RGB uint8
    bytes, row-major. The T temporal copies of a still image must be equal."""
    out, start = [], 0
    for t, gh, gw in grids:
        assert t == 1
        rows = pixel_values[start:start + gh * gw].reshape(gh // merge, gw // merge, merge, merge, 3, 2, patch, patch)
        start += gh * gw
        assert np.array_equal(rows[:, :, :, :, :, 0], rows[:, :, :, :, :, 1])
        hwc = rows[:, :, :, :, :, 0].transpose(0, 2, 5, 1, 3, 6, 4).reshape(gh * patch, gw * patch, 3)
        assert np.array_equal(hwc, np.round(hwc)) and hwc.min() >= 0 and hwc.max() <= 255
        out.append(hwc.astype(np.uint8).tobytes())
    assert start == len(pixel_values)
    return out


@pytest.mark.parametrize("variant", list(PRE))
def test_pixels_and_grids_equal_the_image_processor(folders, tmp_path, variant):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pre = PRE[variant]
    folder = folders["qwen2_vl"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(pre))
    config = ip.image_config(tmp_path)
    low, high = (3136, 28 * 28 * 64) if variant != "size" else (28 * 28 * 8, 28 * 28 * 30)
    assert (config.min_pixels, config.max_pixels, config.resample) == (low, high, pre["resample"])
    reference = Qwen2VLImageProcessorPil(**{k: v for k, v in pre.items()
                                            if k not in ("image_processor_type", "processor_class")})
    pics = images() if variant != "no-resize" else [("56x84", rgb(84, 56)), ("112x140", rgb(140, 112))]
    for name, image in pics:
        for fmt in ("PNG", "WEBP", "GIF") if name == "90x50" else ("PNG",):
            data = encoded(image, fmt)
            theirs = reference(Image.open(io.BytesIO(data)), do_rescale=False, do_normalize=False,
                               return_tensors="np")
            t, gh, gw = (int(v) for v in theirs["image_grid_thw"][0])
            # every shape smart_resize gives is taken, its clamp of a very long side past max_pixels too
            height, width, pixels = ip.process_image(config, data)
            assert (height, width) == (gh * 14, gw * 14), (name, fmt)
            assert pixels == their_images(theirs["pixel_values"], theirs["image_grid_thw"])[0], (name, fmt)
            ids, placed = ip.expand_placeholders(config, [7, config.image_token_id], [(height, width, pixels)])
            assert len(ids) == 1 + gh * gw // 4 and not image_problem(placed, ids, worker_vision(folder, config))


def test_the_workers_size_rule_is_smart_resizes():
    """One rule for both sides (vision_config.dynamic_size_problem): sides multiples of the factor,
    pixels in range, and past max_pixels only smart_resize's clamp (short side = factor, at most 200 times
    longer)."""
    from pagedserve.common.vision_config import dynamic_size_problem
    assert dynamic_size_problem(56, 84, 28, 3136, 50176) is None
    assert "multiples of 28" in dynamic_size_problem(56, 85, 28, 3136, 50176)
    assert "3136 to 50176" in dynamic_size_problem(28, 84, 28, 3136, 50176)  # below min_pixels
    assert "3136 to 50176" in dynamic_size_problem(252, 252, 28, 3136, 50176)  # over, not clamped
    assert dynamic_size_problem(28, 2744, 28, 3136, 50176) is None  # smart_resize's 3000x20
    assert dynamic_size_problem(5600, 28, 28, 3136, 50176) is None
    assert "3136 to 50176" in dynamic_size_problem(28, 5628, 28, 3136, 50176)


def worker_vision(folder, config) -> dict:
    """ModelConfig.vision as the worker reads the folder (its pixel range from preprocessor_config.json)."""
    vision = vision_parts(json.loads((folder / "config.json").read_text()))[1]
    return {**vision, "min_pixels": config.min_pixels, "max_pixels": config.max_pixels}


def test_smart_resize_equals_transformers_on_many_shapes():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as theirs

    rng = np.random.default_rng(2)
    shapes = [(int(h), int(w)) for h, w in rng.integers(1, 5000, (400, 2))] + \
        [(1, 1), (1, 200), (200, 1), (27, 29), (14, 14), (42, 42), (70, 70), (28 * 37, 28 * 41)]
    for low, high in ((3136, 28 * 28 * 64), (56 * 56, 28 * 28 * 1280), (3136, 12845056), (100, 100_000)):
        for h, w in shapes:
            try:
                want = theirs(h, w, 28, low, high)
            except ValueError:
                with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
                    smart_resize(h, w, 28, low, high)
                continue
            assert smart_resize(h, w, 28, low, high) == want, (h, w, low, high)


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_equal_the_processor_for_the_chat_templates_prompt(folders, family):
    folder = folders[family]
    config = ip.image_config(folder)
    processor = reference_processor(folder)
    tokenizer = processor.tokenizer
    text = processor.apply_chat_template(chat(2), add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                    "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>"
                    "What is in these?<|im_end|>\n<|im_start|>assistant\n")
    pairs = [(rgb(90, 50, 1), rgb(19, 7, 2)), (rgb(640, 480, 3), rgb(28, 28, 4)), (rgb(333, 1001, 5), rgb(1, 1, 6))]
    for pics in pairs:
        theirs = processor(text=text, images=list(pics), return_tensors="np", add_special_tokens=False,
                           do_rescale=False, do_normalize=False)
        ids, placed = ip.expand_placeholders(config, tokenizer.encode(text, add_special_tokens=False),
                                             [ip.process_image(config, p) for p in pics])
        assert ids == [int(t) for t in theirs["input_ids"][0]]
        assert [p.data for p in placed] == their_images(theirs["pixel_values"], theirs["image_grid_thw"])
        grids = [(int(h), int(w)) for _, h, w in theirs["image_grid_thw"]]
        assert [(p.height, p.width, p.length) for p in placed] == [(h * 14, w * 14, h * w // 4) for h, w in grids]
        assert all(ids[p.offset - 1] == config.vision_start_token_id for p in placed)
        assert all(ids[p.offset:p.end] == [config.image_token_id] * p.length for p in placed)
        assert placed[0].end < placed[1].offset and placed[0].hash != placed[1].hash
        assert not image_problem(placed, ids, worker_vision(folder, config))
        # vLLM's raw prompt shape for Qwen2-VL (LLM.generate's multi_modal_data) gives the same
        assert prompt_images(config, tokenizer.encode(text, add_special_tokens=False), list(pics)) == (ids, placed)


def test_a_template_kept_in_the_processors_chat_template_json_is_used(folders, tmp_path):
    """Some vision-language folders keep the chat template in chat_template.json only (the processor's
    file, which the tokenizer does not read): the tokenizer takes it from there, as vLLM does; a
    template of the tokenizer's own wins."""
    import shutil
    folder = shutil.copytree(folders["qwen2_vl"], tmp_path / "m")
    template = load_tokenizer(folder).chat_template
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name in ("chat_template.jinja",):
        (folder / name).unlink(missing_ok=True)
    assert load_tokenizer(folder).chat_template is None
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert load_tokenizer(folder).chat_template == template
    (folder / "chat_template.jinja").write_text("{{ 'own' }}")
    assert load_tokenizer(folder).chat_template == "{{ 'own' }}"
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt chat_template.json"):
        load_tokenizer(folder)


def test_string_and_list_contents_render_as_the_template_does(folders):
    """The template loops over content lists (vLLM's "openai" format: a string becomes one text part):
    a system string, image parts in the client's order between text parts, an assistant's string."""
    folder = folders["qwen2_vl"]
    tokenizer = load_tokenizer(folder)
    config = ip.image_config(folder, tokenizer)
    a, b = encoded(rgb(60, 40, 7)), encoded(rgb(40, 90, 8))
    url = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(a).decode()}}
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "First"}, url, {"type": "text", "text": "then"},
                                             {"type": "image", "image": b}]},
                {"role": "assistant", "content": "Two."}, {"role": "user", "content": "Sure?"}]
    ids, placed, text = chat_prompt(tokenizer, config, messages)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nFirst<|vision_start|><|image_pad|>"
                    "<|vision_end|>then<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
                    "Two.<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n")
    processor = reference_processor(folder)
    theirs = processor(text=text, images=[Image.open(io.BytesIO(a)), Image.open(io.BytesIO(b))],
                       return_tensors="np", add_special_tokens=False)
    assert ids == [int(t) for t in theirs["input_ids"][0]]
    assert [(p.height, p.width) for p in placed] == [(h * 14, w * 14) for _, h, w in theirs["image_grid_thw"]]
    _, _, plain = chat_prompt(tokenizer, config, [{"role": "user", "content": "Hi"}])
    assert plain == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                  add_generation_prompt=True)


def test_folders_that_disagree_with_the_vision_tower_or_the_tokenizer_are_refused(folders, tmp_path):
    folder = folders["qwen2_5_vl"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    cases = [({"patch_size": 16}, "patch_size 16 is not the vision tower's 14"),
             ({"merge_size": 1}, "merge_size 1 is not the vision tower's 2"),
             ({"temporal_patch_size": 1}, "temporal_patch_size 1 is not the vision tower's 2"),
             ({"min_pixels": 9000, "max_pixels": 8000}, "pixel range 9000..8000 is empty")]
    for change, message in cases:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, **change}))
        with pytest.raises(ValueError, match=message):
            ip.image_config(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**SIZED, "size": {"height": 28, "width": 28}}))
    with pytest.raises(ValueError, match="size must be {'shortest_edge', 'longest_edge'}"):
        ip.image_config(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, "size": {"height": 28}}))
    assert ip.image_config(tmp_path).max_pixels == 28 * 28 * 64  # min/max_pixels stand in for size
    (tmp_path / "preprocessor_config.json").unlink()  # the processor's defaults
    assert (ip.image_config(tmp_path).min_pixels, ip.image_config(tmp_path).max_pixels) == (3136, 28 * 28 * 1280)
    (tmp_path / "config.json").write_text(json.dumps({**config, "image_token_id": 5}))
    with pytest.raises(ValueError, match=r"makes <\|image_pad\|> \[\d+\], not config.json's image_token_id 5"):
        ip.image_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "vision_start_token_id": 7}))
    with pytest.raises(ValueError, match="vision_start_token_id 7"):
        ip.image_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    from pagedserve.model_files.default_model import resolve_model
    with pytest.raises(ValueError, match=r"the tokenizer makes <\|image_pad\|> \["):  # a tokenizer without it
        ip.image_config(tmp_path, load_tokenizer(resolve_model(None)))


def test_counts_and_refusals(folders):
    config = ip.image_config(folders["qwen2_vl"])
    one = ip.process_image(config, encoded(rgb(60, 40)))
    assert one[:2] == (56, 84)  # 28x56 by rounding: under min_pixels, so scaled up
    with pytest.raises(ValueError, match="1 image tokens .* for 2 images"):
        ip.expand_placeholders(config, [1, config.image_token_id, 2], [one, one])
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        ip.process_image(config, encoded(rgb(201, 1)))
    with pytest.raises(ValueError, match="could not be decoded"):
        ip.process_image(config, encoded(rgb(60, 40))[:60])
    import dataclasses
    fixed = dataclasses.replace(config, do_resize=False)
    with pytest.raises(ValueError, match="do_resize is false.*multiples of 28"):
        ip.process_image(fixed, encoded(rgb(60, 40)))
    with pytest.raises(ValueError, match=r"of 28x28 = 784 pixels: this model takes 3136 to .* \(do_resize is false\)"):
        ip.process_image(fixed, encoded(rgb(28, 28)))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tokenizer_service_sends_the_processors_prompt_and_images(folders, family):
    """A chat with two images through the tokenizer service (image_checks.check_tokenizer_service): the
    ImageInputs sent are the processor's pixels, at its grids' sizes, over that many image tokens."""
    def check_images(theirs, want, got, config):
        assert [g.data for g in got] == their_images(theirs["pixel_values"], theirs["image_grid_thw"])
        grids = [(int(h), int(w)) for _, h, w in theirs["image_grid_thw"]]
        assert [(g.height, g.width, g.length) for g in got] == [(h * 14, w * 14, h * w // 4) for h, w in grids]
        assert all(want[g.offset:g.end] == [config.image_token_id] * g.length for g in got)
    folder = folders[family]
    check_tokenizer_service(folder, reference_processor(folder), check_images)


def test_the_offline_apis_encoding_takes_vllms_qwen2_vl_prompt_shape(folders):
    """LLM.generate / AsyncLLM.generate's {"prompt": ..."<|vision_start|><|image_pad|><|vision_end|>"...,
    "multi_modal_data": {"image": ...}} (an image alone or a list; bytes or PIL) and LLM.chat's image
    parts encode as the processor does (engine/llm.py's encode_with_images and encode_chat)."""
    from pagedserve.engine.llm import encode_chat, encode_with_images

    folder = folders["qwen2_5_vl"]
    tokenizer = load_tokenizer(folder)
    config = ip.image_config(folder, tokenizer)
    processor = reference_processor(folder)
    prompt = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
              "<|vision_start|><|image_pad|><|vision_end|>Describe it.<|im_end|>\n<|im_start|>assistant\n")
    assert prompt == processor.apply_chat_template(chat(1, "Describe it."), add_generation_prompt=True)
    image = rgb(120, 70, 21)
    theirs = processor(text=prompt, images=[image], return_tensors="np", do_rescale=False, do_normalize=False)
    want = [int(t) for t in theirs["input_ids"][0]]
    for value in (image, encoded(image), [encoded(image)]):
        text, ids, placed = encode_with_images(tokenizer, config, {"prompt": prompt,
                                                                   "multi_modal_data": {"image": value}}, "prompts[0]")
        assert (text, ids) == (prompt, want)
        assert [p.data for p in placed] == their_images(theirs["pixel_values"], theirs["image_grid_thw"])
    with pytest.raises(ValueError, match=r"prompts\[1\]: the prompt has 1 image tokens .* for 2 images"):
        encode_with_images(tokenizer, config, {"prompt": prompt, "multi_modal_data": {"image": [image, image]}},
                           "prompts[1]")
    url = "data:image/png;base64," + base64.b64encode(encoded(image)).decode()
    ids, text, placed = encode_chat(tokenizer, config, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]}])
    assert (ids, text) == (want, prompt) and len(placed) == 1


def test_huge_images_at_the_hub_pixel_range(folders, tmp_path):
    """Qwen2-VL-7B-Instruct's range (max_pixels 12845056): a 2500x1800 photo-sized image stays near its
    own size, a very wide one is scaled to fit; pixels equal the image processor's."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pre = {**PREPROCESSOR, "max_pixels": 12845056}
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folders["qwen2_vl"] / name).read_bytes())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(pre))
    config = ip.image_config(tmp_path)
    reference = Qwen2VLImageProcessorPil(**{k: v for k, v in pre.items()
                                            if k not in ("image_processor_type", "processor_class")})
    y, x = np.mgrid[0:1800, 0:2500]
    noise = np.random.default_rng(3).integers(0, 32, (1800, 2500, 3))
    photo = Image.fromarray(((np.stack([x % 256, y % 256, (x + y) % 256], -1) + noise) % 256).astype(np.uint8))
    for image in (photo, photo.resize((7000, 40))):
        data = encoded(image)
        theirs = reference(Image.open(io.BytesIO(data)), do_rescale=False, do_normalize=False, return_tensors="np")
        height, width, pixels = ip.process_image(config, data)
        _, gh, gw = theirs["image_grid_thw"][0]
        assert (height, width) == (gh * 14, gw * 14) and height * width > 28 * 28 * 64
        assert pixels == their_images(theirs["pixel_values"], theirs["image_grid_thw"])[0]

"""model_files/image_processing.py against transformers: the resized, cropped RGB of
CLIPImageProcessor (before rescale/normalize) and LlavaProcessor's placeholder expansion."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from pagedserve.model_files import image_processing as ip
from tiny_llava import PREPROCESSOR, build_tiny_llava


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory):
    from pagedserve.model_files.default_model import resolve_model
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), resolve_model(None))


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def images() -> list[tuple[str, Image.Image]]:
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (41, 29, 4), dtype=np.uint8), "RGBA")
    gray = Image.fromarray(rng.integers(0, 256, (33, 71), dtype=np.uint8), "L")
    palette = rgb.resize((61, 45)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    tiny = Image.fromarray(rng.integers(0, 256, (7, 19, 3), dtype=np.uint8))  # smaller than the crop after resize
    return [("rgb", rgb), ("rgba", rgba), ("gray", gray), ("palette", palette), ("tiny", tiny)]


@pytest.mark.parametrize("size", [{"shortest_edge": 32}, {"height": 35, "width": 31}, {"shortest_edge": 17}])
def test_pixels_equal_clip_image_processor(tmp_path, size):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    pre = {**PREPROCESSOR, "size": size}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"],
                                                      "image_token_index": 5,
                                                      "vision_config": {"patch_size": 10, "image_size": 30}}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(pre))
    config = ip.image_config(tmp_path)
    reference = CLIPImageProcessorPil(**{k: v for k, v in pre.items() if k != "image_processor_type"})
    for name, image in images():
        for fmt in ("PNG", "WEBP", "GIF") if name == "rgb" else ("PNG",):
            data = encoded(image, fmt)
            height, width, pixels = ip.process_image(config, data)
            theirs = reference(Image.open(io.BytesIO(data)), do_rescale=False, do_normalize=False,
                               return_tensors="np")["pixel_values"][0]
            theirs = np.asarray(theirs).transpose(1, 2, 0).astype(np.uint8)  # CHW -> HWC
            assert (height, width) == theirs.shape[:2], (name, fmt)
            assert pixels == theirs.tobytes(), (name, fmt)


def test_placeholders_equal_llava_processor(llava_folder):
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from pagedserve.model_files.tokenizer_files import load_tokenizer

    tokenizer = load_tokenizer(llava_folder)
    pre = {k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"}
    processor = LlavaProcessor(CLIPImageProcessorPil(**pre), tokenizer, patch_size=10,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=tokenizer.chat_template)
    config = ip.image_config(llava_folder)
    assert config.tokens_per_image == 9
    pics = [image for _, image in images()[:2]]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"},
                                             {"type": "image"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    theirs = processor(text=text, images=pics, return_tensors="np")
    prompt = tokenizer.encode(text, add_special_tokens=True)
    ids, placed = ip.expand_placeholders(config, prompt, [ip.process_image(config, encoded(p)) for p in pics])
    assert ids == [int(t) for t in theirs["input_ids"][0]]
    assert len(ids) == len(prompt) + 2 * 8
    assert [(p.length, p.height, p.width) for p in placed] == [(9, 30, 30)] * 2
    assert all(ids[p.offset:p.end] == [config.image_token_id] * 9 for p in placed)
    assert len(placed) == 2 and placed[0].hash and placed[0].hash != placed[1].hash


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_counts_and_limits(llava_folder):
    config = ip.image_config(llava_folder)
    one = ip.process_image(config, encoded(images()[0][1]))
    with pytest.raises(ValueError, match="1 image tokens .* for 2 images"):
        ip.expand_placeholders(config, [1, config.image_token_id, 2], [one, one])
    with pytest.raises(ValueError, match="not an image"):
        ip.open_image(b"hello, world")
    with pytest.raises(ValueError, match="could not be decoded"):
        ip.process_image(config, encoded(images()[0][1])[:60])
    big = encoded(Image.new("L", (7000, 6000)))  # 42 M pixels, a small PNG
    with pytest.raises(ValueError, match="pixels"):
        ip.open_image(big)
    assert ip.image_config(llava_folder.parent) is None  # no config.json: no images
    other = llava_folder.parent / "paligemma"
    other.mkdir(exist_ok=True)
    (other / "config.json").write_text(json.dumps({"architectures": ["PaliGemmaForConditionalGeneration"],
                                                   "image_token_index": 257152}))
    assert ip.image_config(other) is None  # an image model the worker does not encode: text only


def test_processor_files_that_disagree_with_the_vision_tower_are_refused(tmp_path):
    """The front end's placeholders per image are the worker's (common/vision_config.py): a folder whose
    crop or image_seq_length says otherwise would send images the worker cannot take."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"],
                                                      "image_token_index": 5,
                                                      "vision_config": {"patch_size": 10, "image_size": 30}}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, "crop_size": 40}))
    with pytest.raises(ValueError, match="makes 40x40 images: the vision tower takes 30x30"):
        ip.image_config(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": 10}))
    with pytest.raises(ValueError, match="image_seq_length 10 is not the 9 rows"):
        ip.image_config(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": 9}))
    assert ip.image_config(tmp_path).tokens_per_image == 9

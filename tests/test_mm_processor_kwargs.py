"""--mm-processor-kwargs (common/processor_kwargs.py): the front end's image config with overrides equals
transformers' image processor built with the same kwargs (Qwen2VLImageProcessorPil: sizes, pixels and
placeholder counts on many images; Idefics3's tiles), the worker's vision settings (ModelConfig.from_folder)
get the same bounds, so an image the override lets past the folder's own max_pixels is accepted by
image_problem; what is refused at start, naming the key; the launcher hands the flag to the tokenizer and
the worker. On tiny folders (tests/tiny_*.py), no weights."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from pagedserve.common.model_config import ModelConfig
from pagedserve.common.vision_config import image_problem
from pagedserve.model_files import image_processing as ip
from image_checks import rgb
from test_qwen_vl_images import SIZED, images
from tiny_idefics3 import PREPROCESSOR as IDEFICS3_PRE
from tiny_idefics3 import build_tiny_idefics3
from tiny_idefics3 import reference_processor as idefics3_processor
from tiny_pixtral import build_tiny_pixtral
from tiny_qwen2_vl import PREPROCESSOR, build_tiny_qwen2_vl

SKIP = ("image_processor_type", "processor_class")
FOLDER_MAX = 28 * 28 * 64  # the tiny folder's own max_pixels
# (the folder's preprocessor_config.json, the overrides): past the folder's max, under it, a range, size
CASES = {"wider": (PREPROCESSOR, {"max_pixels": 28 * 28 * 150}),
         "narrower": (PREPROCESSOR, {"max_pixels": 28 * 28 * 12}),
         "range": (PREPROCESSOR, {"min_pixels": 28 * 28 * 20, "max_pixels": 28 * 28 * 40}),
         "size": (SIZED, {"size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 100}})}


@pytest.fixture(scope="module")
def qwen(default_model_path, tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("mmk-qwen"), default_model_path)


def with_pre(folder, tmp_path, pre: dict):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(pre))
    return tmp_path


@pytest.mark.parametrize("case", list(CASES))
def test_qwen2_vl_overrides_equal_the_image_processor_with_the_same_kwargs(qwen, tmp_path, case):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from test_qwen_vl_images import their_images

    pre, kwargs = CASES[case]
    folder = with_pre(qwen, tmp_path, pre)
    config = ip.image_config(folder, None, json.dumps(kwargs))  # the flag's text
    assert ip.image_config(folder, None, kwargs) == config  # LLM's dict
    reference = Qwen2VLImageProcessorPil(**{**{k: v for k, v in pre.items() if k not in SKIP}, **kwargs})
    vision = ModelConfig.from_folder(folder, json.dumps(kwargs)).vision
    assert (vision["min_pixels"], vision["max_pixels"]) == (config.min_pixels, config.max_pixels)
    for name, image in images():
        data = io.BytesIO()
        image.save(data, format="PNG")
        theirs = reference(Image.open(io.BytesIO(data.getvalue())), do_rescale=False, do_normalize=False,
                           return_tensors="np")
        _, gh, gw = (int(v) for v in theirs["image_grid_thw"][0])
        height, width, pixels = ip.process_image(config, data.getvalue())
        assert (height, width) == (gh * 14, gw * 14), name
        assert pixels == their_images(theirs["pixel_values"], theirs["image_grid_thw"])[0], name
        ids, placed = ip.expand_placeholders(config, [7, config.image_token_id], [(height, width, pixels)])
        assert len(ids) == 1 + gh * gw // 4, name
        assert image_problem(placed, ids, vision) is None, name  # the worker takes what the front end made


def test_an_image_past_the_folders_max_pixels_is_the_workers_with_the_override_only(qwen):
    kwargs = {"max_pixels": 28 * 28 * 150}
    config = ip.image_config(qwen, None, kwargs)
    height, width, pixels = ip.process_image(config, rgb(400, 300))
    assert height * width > FOLDER_MAX
    ids, placed = ip.expand_placeholders(config, [7, config.image_token_id], [(height, width, pixels)])
    assert image_problem(placed, ids, ModelConfig.from_folder(qwen, kwargs).vision) is None
    assert "3136 to 50176" in image_problem(placed, ids, ModelConfig.from_folder(qwen).vision)
    assert ip.image_config(qwen, None, None).max_pixels == FOLDER_MAX  # unset: the folder's own


@pytest.mark.parametrize("kwargs, says", [
    ('{"max_pixels": ', "--mm-processor-kwargs is not JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"do_pan_and_scan": True}, "'do_pan_and_scan' is not a setting of this model's image processor"),
    ({"max_image_size": {"longest_edge": 32}}, "'max_image_size' is not a setting"),
    ({"min_pixels": 28 * 28 * 50, "max_pixels": 28 * 28 * 10}, "min_pixels 39200 is over max_pixels 7840"),
    ({"min_pixels": 28 * 28 * 100}, "min_pixels 78400 is over max_pixels 50176"),  # over the folder's max
    ({"max_pixels": "1003520"}, "max_pixels must be a positive integer"),
    ({"max_pixels": True}, "max_pixels must be a positive integer"),
    ({"max_pixels": 0}, "max_pixels must be a positive integer"),
    ({"min_pixels": 500, "max_pixels": 700}, "max_pixels 700 is under the tower's smallest image (784 pixels)"),
    ({"size": {"longest_edge": 7840, "height": 5}}, "size must be an object of shortest_edge, longest_edge"),
])
def test_refusals_name_the_key_on_both_sides(qwen, kwargs, says):
    with pytest.raises(ValueError, match="--mm-processor-kwargs") as front:
        ip.image_config(qwen, None, kwargs)
    with pytest.raises(ValueError) as worker:
        ModelConfig.from_folder(qwen, kwargs)
    assert says in str(front.value) and str(worker.value) == str(front.value)


def test_a_text_model_is_refused_and_llava_takes_no_keys(default_model_path, tmp_path):
    from tiny_llava import build_tiny_llava
    for read in (lambda f, k: ip.image_config(f, None, k), ModelConfig.from_folder):
        with pytest.raises(ValueError, match="--mm-processor-kwargs is set but this model takes no images"):
            read(default_model_path, {"max_pixels": 1003520})
    assert ip.image_config(default_model_path, None, "") is None and ModelConfig.from_folder(default_model_path, {})
    llava = build_tiny_llava(tmp_path, default_model_path)
    with pytest.raises(ValueError, match=r"'size' is not a setting of this model's image processor \(it takes: none\)"):
        ip.image_config(llava, None, {"size": {"shortest_edge": 336}})


def test_idefics3_size_and_splitting_as_the_processor_and_the_towers_tile_checked(default_model_path, tmp_path):
    folder = build_tiny_idefics3(tmp_path, default_model_path)
    kwargs = {"size": {"longest_edge": 96}, "do_image_splitting": True}
    config = ip.image_config(folder, None, kwargs)
    processor = idefics3_processor(folder, {**IDEFICS3_PRE, **kwargs})
    for image in (rgb(200, 120, 1), rgb(40, 90, 2)):
        text = "User:<image>What?<end_of_utterance>\nAssistant:"
        theirs = processor(text=text, images=[[image]], return_tensors="np", add_special_tokens=False)
        ids, _ = ip.expand_placeholders(config, processor.tokenizer.encode(text, add_special_tokens=False),
                                        [ip.process_image(config, image)])
        assert ids == [int(t) for t in theirs["input_ids"][0]]
    assert len(ids) > len(ip.expand_placeholders(ip.image_config(folder), processor.tokenizer.encode(
        text, add_special_tokens=False), [ip.process_image(ip.image_config(folder), image)])[0])
    assert not ip.image_config(folder, None, {"do_image_splitting": False}).do_image_splitting
    with pytest.raises(ValueError, match=r"makes 64x64 tiles: the vision tower takes 32x32 \(with "
                                         r"--mm-processor-kwargs \{\"max_image_size\""):
        ip.image_config(folder, None, {"max_image_size": {"longest_edge": 64}})
    with pytest.raises(ValueError, match="do_image_splitting must be true or false"):
        ip.image_config(folder, None, {"do_image_splitting": "no"})


def test_pixtral_size_within_the_towers_reach(default_model_path, tmp_path):
    folder = build_tiny_pixtral(tmp_path, default_model_path)
    assert ip.image_config(folder, None, {"size": {"longest_edge": 56}}).max_hw == (56, 56)
    with pytest.raises(ValueError, match="the vision tower takes at most 112 .* --mm-processor-kwargs"):
        ip.image_config(folder, None, {"size": {"longest_edge": 224}})
    with pytest.raises(ValueError, match="'min_pixels' is not a setting .*it takes: size"):
        ip.image_config(folder, None, {"min_pixels": 3136})


def test_the_launcher_hands_the_flag_to_the_tokenizer_and_the_worker():
    from pagedserve.common.settings import settings_of
    from pagedserve.common.settings_cli import argv_for

    value = '{"max_pixels": 1003520}'
    for service in ("tokenizer", "worker"):
        argv = argv_for(service, {"mm_processor_kwargs": value})
        assert argv[argv.index("--mm-processor-kwargs") + 1] == value
    assert [s for s in settings_of("engine") if s.dest == "mm_processor_kwargs"]
    assert not [s for s in settings_of("gateway") if s.dest == "mm_processor_kwargs"]

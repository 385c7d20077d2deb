"""Idefics3 / SmolVLM's image front end (model_files/idefics3_images.py through image_processing.py)
against transformers' Idefics3Processor on a tiny folder (tests/tiny_idefics3.py): the expanded
input_ids equal, and each tile and global view equal its pixel_values un-normalized, in order, with
and without do_image_splitting; the tokenizer service and the offline path give the same."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json

import numpy as np
import pytest
from PIL import Image

from pagedserve.common.multimodal import image_from_proto
from pagedserve.model_files import image_processing as ip
from pagedserve.model_files.prompt_images import chat_prompt, prompt_images
from pagedserve.model_files.tokenizer_files import load_tokenizer
from image_checks import offline_chat
from tiny_idefics3 import PREPROCESSOR, build_tiny_idefics3, reference_processor

UNSPLIT = {**PREPROCESSOR, "do_image_splitting": False}
ONE_TILE = {**PREPROCESSOR, "size": {"longest_edge": 32}}  # splitting, but no image is larger than a tile
PRE = {"split": PREPROCESSOR, "unsplit": UNSPLIT, "one-tile": ONE_TILE}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from pagedserve.model_files.default_model import resolve_model
    model = resolve_model(None)
    return {name: build_tiny_idefics3(tmp_path_factory.mktemp(f"tiny-idefics3-{name}"), model, pre)
            for name, pre in PRE.items()}


def images() -> list[tuple[str, Image.Image]]:
    rng = np.random.default_rng(0)

    def rgb(width, height):
        return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return [("small", rgb(19, 7)), ("tile", rgb(32, 32)), ("wide", rgb(150, 40)), ("tall", rgb(30, 121)),
            ("square", rgb(64, 64)), ("odd", rgb(97, 61)), ("big", rgb(300, 200)),
            ("rgba", Image.fromarray(rng.integers(0, 256, (41, 29, 4), dtype=np.uint8), "RGBA")),
            ("gray", Image.fromarray(rng.integers(0, 256, (33, 71), dtype=np.uint8), "L"))]


def encoded(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def their_frames(pixel_values: np.ndarray) -> list[bytes]:
    """pixel_values (frames x 3 x H x W, normalized with mean = std = 0.5) as RGB uint8 bytes."""
    return [np.rint((frame.transpose(1, 2, 0) * 0.5 + 0.5) * 255).astype(np.uint8).tobytes()
            for frame in pixel_values]


def chat(count: int) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(count)),
                                         {"type": "text", "text": "What is in these?"}]}]


@pytest.mark.parametrize("split", list(PRE))
def test_ids_and_tiles_equal_idefics3_processor(folders, split):
    folder = folders[split]
    config = ip.image_config(folder)
    assert (config.tile, config.tokens_per_image, config.do_image_splitting) == (32, 4, split != "unsplit")
    processor = reference_processor(folder, PRE[split])
    tokenizer = processor.tokenizer
    text = processor.apply_chat_template(chat(1), add_generation_prompt=True)
    assert text == "<|im_start|>User:<image>What is in these?<end_of_utterance>\nAssistant:"
    grids = set()
    for name, image in images():
        theirs = processor(text=text, images=[image], return_tensors="np", add_special_tokens=False)
        tiled = ip.process_image(config, encoded(image))
        ids, placed = ip.expand_placeholders(config, tokenizer.encode(text, add_special_tokens=False), [tiled])
        assert ids == [int(t) for t in theirs["input_ids"][0]], name
        assert [p.data for p in placed] == their_frames(theirs["pixel_values"][0]), name
        assert all((p.length, p.height, p.width) == (4, 32, 32) for p in placed)
        assert all(ids[p.offset:p.end] == [config.image_token_id] * 4 for p in placed)
        assert ids.count(config.image_token_id) == 4 * len(placed) == 4 * (tiled.rows * tiled.cols + 1)
        grids.add((tiled.rows, tiled.cols))
    # every image is resized to a long edge of 64 (2 tiles) or 32 (one: the global view alone)
    assert grids == ({(1, 2), (2, 1), (2, 2)} if split == "split" else {(0, 0)})


def test_two_images_in_one_prompt(folders):
    folder = folders["split"]
    config = ip.image_config(folder)
    processor = reference_processor(folder)
    text = processor.apply_chat_template(chat(2), add_generation_prompt=True)
    pics = [images()[2][1], images()[3][1]]  # 1 x 2 tiles + global, then 2 x 1 + global
    theirs = processor(text=text, images=pics, return_tensors="np", add_special_tokens=False)
    ids, placed = ip.expand_placeholders(config, processor.tokenizer.encode(text, add_special_tokens=False),
                                         [ip.process_image(config, p) for p in pics])
    assert ids == [int(t) for t in theirs["input_ids"][0]]
    assert [p.data for p in placed] == their_frames(theirs["pixel_values"][0])
    assert len(placed) == 6 and all(a.end <= b.offset for a, b in zip(placed, placed[1:]))


def test_folders_that_disagree_with_the_vision_tower_are_refused(folders, tmp_path):
    folder = folders["split"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["SmolVLMForConditionalGeneration"]}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 4}))
    assert ip.image_config(tmp_path).tokens_per_image == 4  # SmolVLM's architecture reads the same
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 16}))
    with pytest.raises(ValueError, match="image_seq_len 16 is not the 4 rows"):
        ip.image_config(tmp_path)
    (tmp_path / "processor_config.json").unlink()  # the processor's default: 169
    with pytest.raises(ValueError, match="image_seq_len 169"):
        ip.image_config(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 4}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR,
                                                                   "max_image_size": {"longest_edge": 64}}))
    with pytest.raises(ValueError, match="makes 64x64 tiles: the vision tower takes 32x32"):
        ip.image_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "image_token_id": 5}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    with pytest.raises(ValueError, match="not config.json's image token 5"):
        ip.image_config(tmp_path)
    from pagedserve.model_files.default_model import resolve_model
    from tiny_llava import build_tiny_llava
    (tmp_path / "llava").mkdir()
    tokenizer = load_tokenizer(build_tiny_llava(tmp_path / "llava", resolve_model(None)))  # <image> alone
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    (tmp_path / "config.json").write_text(json.dumps({**config, "image_token_id": image_token}))
    with pytest.raises(ValueError, match="has no <fake_token_around_image> token"):
        ip.image_config(tmp_path, tokenizer)


def test_counts_and_limits(folders):
    config = ip.image_config(folders["split"])
    one = ip.process_image(config, encoded(images()[0][1]))
    with pytest.raises(ValueError, match="1 image tokens .* for 2 images"):
        ip.expand_placeholders(config, [1, config.image_token_id, 2], [one, one])
    with pytest.raises(ValueError, match="could not be decoded"):
        ip.process_image(config, encoded(images()[0][1])[:60])
    from pagedserve.model_files.idefics3_images import read_pieces
    pieces = read_pieces(load_tokenizer(folders["split"]), config.image_token_id, 4, 1)  # a one-tile model
    assert len(pieces["row_col"]) == 1 and pieces["fake"] == config.fake
    big = dataclasses.replace(config, row_col=(config.row_col[0][:1],))  # at most 1 x 1 tiles
    with pytest.raises(ValueError, match="makes 2x2 tiles: this model's processor makes at most 1x1"):
        ip.process_image(big, images()[4][1])


def test_the_tokenizer_service_and_the_offline_path_expand_as_the_processor(folders):
    from pagedserve.v1 import generate_pb2
    from test_tokenizer_images import chat_with_images
    from test_tokenizer_service import collect, start_stack, streamer

    folder = folders["split"]
    tokenizer = load_tokenizer(folder)
    config = ip.image_config(folder, tokenizer)
    pics = [images()[6][1], images()[0][1]]
    data = [encoded(p) for p in pics]
    processor = reference_processor(folder)
    text = processor.apply_chat_template(
        [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
         {"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                      {"type": "text", "text": "What is in these?"}]}], add_generation_prompt=True)
    theirs = processor(text=text, images=[Image.open(io.BytesIO(d)) for d in data], return_tensors="np",
                       add_special_tokens=False)
    want = [int(t) for t in theirs["input_ids"][0]]
    frames = their_frames(theirs["pixel_values"][0])

    async def main():
        stub, fake, _, _, stop = await start_stack(tokenizer, [streamer([5, 6])], images=config)
        try:
            res = await collect(stub, chat_with_images(*data))
            sent = fake.requests[0]
            assert list(sent.prompt_token_ids) == want
            got = [image_from_proto(m) for m in sent.images]
            assert [g.data for g in got] == frames and len(got) == 5 + 3  # 2 x 2 tiles + global, 1 x 2 + global
            assert all(list(sent.prompt_token_ids)[g.offset:g.end] == [config.image_token_id] * 4 for g in got)
            assert res[0].accepted and res[0].usage.prompt_tokens == len(want)
            ids, offline, _ = offline_chat(tokenizer, config, data)
            assert ids == want and offline == got
            # LLM.generate's {"prompt": text, "multi_modal_data": {"image": [...]}}: the same
            assert prompt_images(config, tokenizer.encode(text, add_special_tokens=False), data) == (want, got)
            tokenized = await stub.Tokenize(generate_pb2.TokenizeRequest(chat=chat_with_images(*data).chat))
            assert list(tokenized.token_ids) == want and tokenized.text == text
        finally:
            await stop()
    asyncio.run(main())


@pytest.mark.parametrize("longest, tile", [(2048, 512), (1456, 364), (5000, 1024), (96, 32)])
def test_tile_grids_equal_the_image_processor(longest, tile):
    """The geometry (resize, multiple of the tile, grid) for SmolVLM's, Idefics3's, a clamped (MAX_SIDE)
    and a small setting, on blank images of extreme shapes; NEAREST keeps the resizes cheap."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from pagedserve.model_files.idefics3_images import Idefics3Config, tile_image

    reference = Idefics3ImageProcessorPil(size={"longest_edge": longest}, max_image_size={"longest_edge": tile},
                                          resample=0, do_rescale=False, do_normalize=False)
    grid = -(-min(longest + 1, 4097) // tile)
    config = Idefics3Config(image_token_id=1, tokens_per_image=1, tile=tile, longest_edge=longest, resample=0,
                            row_col=((((),) * grid),) * grid)
    shapes = [(1, 1), (1, 3000), (3000, 1), (511, 512), (512, 512), (513, 512), (700, 1000), (1000, 700),
              (333, 1001), (37, 4000), (2049, 2048)]
    for height, width in shapes if longest < 2000 else shapes[1:3] + shapes[8:9]:  # the large ones: slow
        image = Image.new("RGB", (width, height))
        theirs = reference(image, return_row_col_info=True, return_tensors="np")
        ours = tile_image(config, image)
        assert (ours.rows, ours.cols) == (theirs["rows"][0][0], theirs["cols"][0][0]), (height, width)
        assert len(ours.frames) == theirs["pixel_values"].shape[1] == max(1, ours.rows * ours.cols + 1)


def test_empty_text_renders_as_one_text_part_as_vllm_does(folders):
    """A list-taking template (SmolVLM's indexes content[0]) gets a string content as one text part, an
    empty one too, as vLLM's "openai" content format gives it; None (an assistant's calls) as none."""
    from pagedserve.model_files.prompt_images import chat_images

    folder = folders["split"]
    tokenizer = load_tokenizer(folder)
    url = "data:image/png;base64," + base64.b64encode(encoded(images()[1][1])).decode()
    image = {"type": "image_url", "image_url": {"url": url}}
    chat = [{"role": "user", "content": [image, {"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": ""}, {"role": "user", "content": "And now?"}]
    rendered, _ = chat_images(chat, list_content=True)
    assert rendered[1]["content"] == [{"type": "text", "text": ""}]
    assert rendered[2]["content"] == [{"type": "text", "text": "And now?"}]
    assert chat_images([{"role": "assistant", "content": None}], list_content=True)[0][0]["content"] == []
    _, _, text = chat_prompt(tokenizer, ip.image_config(folder, tokenizer), chat)
    assert "Assistant: <end_of_utterance>" in text and "User: And now?<end_of_utterance>" in text

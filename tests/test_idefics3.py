"""Idefics3 and SmolVLM on a tiny random model built here (tiny_models.build_tiny_idefics3: a SigLIP tower
of 3 layers over 32x32 tiles, patches of 8, the pixel shuffle by 2, so 4 placeholder tokens a tile; a tiny
Llama): the engine's greedy tokens equal transformers' Idefics3ForConditionalGeneration (float32,
pixel_values from its image processor on the same uint8 tiles, unresized and unsplit) and its logprobs
agree to 1e-4, with one tile, an image's tiles laid out as Idefics3Processor lays them (row/column tokens
and newlines between tiles, the global view last), chunked prefill splitting a tile, a prefix-cache hit,
a batch with a text-only request, two tensor-parallel ranks, SmolVLM's config, and the tower's position
ids equal to transformers' for every tile side."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.common.multimodal import image_input
from tiny_models import IDEFICS3_IMAGE_TOKEN, IDEFICS3_TILE, GREEDY, STEPS, build_tiny_idefics3, check, \
    check_image_and_text, check_prompt_logprobs, greedy_with_pixels, make_engine, run_requests

PLACEHOLDERS = (IDEFICS3_TILE // 8) ** 2 // 4
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)  # the builder's preprocessor_config.json
FAKE, GLOBAL, NEWLINE = 250, 251, 10  # stand-ins for <fake_token_around_image>, <global-img>, "\n"


def tile(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (IDEFICS3_TILE, IDEFICS3_TILE, 3), dtype=np.uint8)


def text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(1000 + seed).integers(3, 240, n).tolist()


def prompt_of(*parts) -> tuple[list[int], list[np.ndarray], list]:
    """parts: token lists and tiles, in order -> (prompt ids, the tiles, their ImageInputs)."""
    ids, pixels, images = [], [], []
    for part in parts:
        if isinstance(part, np.ndarray):
            images.append(image_input(len(ids), PLACEHOLDERS, IDEFICS3_TILE, IDEFICS3_TILE, part.tobytes()))
            pixels.append(part)
            ids += [IDEFICS3_IMAGE_TOKEN] * PLACEHOLDERS
        else:
            ids += part
    return ids, pixels, images


def split_image(rows: int, cols: int, seed: int) -> list:
    """An image split into rows x cols tiles and its global view, as Idefics3Processor lays out their
    tokens: <fake><row_r_col_c><image>*n per tile, "\\n" after each row, then <fake><global-img><image>*n<fake>."""
    parts = []
    for r in range(rows):
        for c in range(cols):
            parts += [[FAKE, 200 + 10 * r + c], tile(seed + r * cols + c)]
        parts.append([NEWLINE])
    return parts + [[NEWLINE, FAKE, GLOBAL], tile(seed + 99), [FAKE]]


class Reference:
    """transformers' model on the folder: greedy tokens and each step's log-softmax, by full forwards; the
    pixel_values [1 prompt, tiles, 3, H, W] from its image processor (no resize, no splitting: the tiles
    as they are, normalized)."""

    def __init__(self, folder, arch: str = "Idefics3ForConditionalGeneration") -> None:
        import transformers
        self.model = getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32).eval()
        processor = getattr(transformers, arch.replace("ForConditionalGeneration", "ImageProcessorPil"))
        self.processor = processor.from_pretrained(folder)

    def pixel_values(self, pixels: list[np.ndarray]) -> torch.Tensor | None:
        if not pixels:
            return None
        values = self.processor(images=[pixels], do_resize=False, do_image_splitting=False,
                                return_tensors="pt").pixel_values
        assert values.shape == (1, len(pixels), 3, IDEFICS3_TILE, IDEFICS3_TILE)
        return values

    def greedy(self, ids: list[int], pixels: list[np.ndarray], steps: int = STEPS):
        return greedy_with_pixels(self.model, ids, self.pixel_values(pixels), steps)


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    folder = build_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))
    return folder, Reference(folder)


def test_config_reads_the_vision_half(idefics3):
    from pagedserve.common.model_config import ModelConfig
    folder, _ = idefics3
    cfg = ModelConfig.from_folder(folder)
    assert cfg.architecture == "Idefics3ForConditionalGeneration" and cfg.hidden_size == 64
    assert not cfg.tie_word_embeddings
    v = cfg.vision
    assert v["text_architecture"] == "LlamaForCausalLM" and v["image_token_id"] == IDEFICS3_IMAGE_TOKEN
    assert (v["num_image_tokens"], v["scale_factor"], v["image_size"]) == (PLACEHOLDERS, 2, IDEFICS3_TILE)
    assert v["image_mean"] == MEAN and v["image_std"] == STD


def test_the_top_level_flag_ties_the_lm_head_not_text_configs():
    """transformers 5 ties by Idefics3Config.tie_word_embeddings (False when absent), not text_config's."""
    from pagedserve.common.model_config import ModelConfig
    cfg = {"architectures": ["Idefics3ForConditionalGeneration"],
           "text_config": {"model_type": "llama", "tie_word_embeddings": True, "vocab_size": 256},
           "vision_config": {"image_size": 512, "patch_size": 16}}
    assert not ModelConfig.from_hf_dict(cfg).tie_word_embeddings
    assert ModelConfig.from_hf_dict({**cfg, "tie_word_embeddings": True}).tie_word_embeddings


@pytest.mark.parametrize("arch, vision, scale, rows", [
    ("Idefics3ForConditionalGeneration", {"image_size": 364, "patch_size": 14}, 2, 169),  # Idefics3-8B's shape
    ("SmolVLMForConditionalGeneration", {"image_size": 512, "patch_size": 16, "hidden_size": 768}, 4, 64),
    ("SmolVLMForConditionalGeneration", {"image_size": 384, "patch_size": 14}, 3, 81),  # 6 pixels past the patches
])
def test_hub_shapes(arch, vision, scale, rows):
    from pagedserve.common.model_config import ModelConfig
    cfg = ModelConfig.from_hf_dict({"architectures": [arch], "scale_factor": scale, "vision_config": vision,
                                    "text_config": {"model_type": "llama", "vocab_size": 49280}})
    assert cfg.architecture == arch and cfg.vision["num_image_tokens"] == rows
    assert cfg.vision["image_token_id"] == 128257 and cfg.vision["hidden_act"] == "gelu_pytorch_tanh"


@pytest.mark.parametrize("side", [4, 19, 25, 26, 27, 29, 32, 38])
def test_tile_position_ids_are_transformers(side):
    """For a whole tile transformers' bucketed position ids; for some sides (19, 25, ...) not 0..N-1."""
    from transformers import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    from pagedserve.worker.vision.siglip import tile_position_ids
    emb = Idefics3VisionEmbeddings(Idefics3VisionConfig(hidden_size=4, image_size=side * 2, patch_size=2))
    with torch.no_grad():
        emb.patch_embedding.weight.zero_()
        emb.patch_embedding.bias.zero_()
        emb.position_embedding.weight.copy_(torch.arange(side * side, dtype=torch.float32)[:, None].expand(-1, 4))
        theirs = emb(torch.zeros(1, 3, side * 2, side * 2), torch.ones(1, side, side, dtype=torch.bool))[0, :, 0]
    assert tile_position_ids(side).tolist() == theirs.long().tolist()
    assert (side in (19, 25, 29, 38)) == (tile_position_ids(side).tolist() != list(range(side * side)))


def test_tiles_past_whole_patches_encode_as_transformers_does(tmp_path):
    """image_size 36, patches of 8: the convolution ("valid") drops the last 4 pixel rows and columns; the
    rows of encode_images equal transformers' get_image_features on the same normalized tiles."""
    import transformers
    folder = build_tiny_idefics3(tmp_path / "odd", seed=2, vision_overrides={"image_size": 36})
    model = make_engine(folder).runner.model
    tiles = np.random.default_rng(5).integers(0, 256, (3, 36, 36, 3), dtype=np.uint8)
    ours = model.encode_images([image_input(0, PLACEHOLDERS, 36, 36, t.tobytes()) for t in tiles])
    x = torch.from_numpy(tiles).permute(0, 3, 1, 2).float() / 255
    values = (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    ref = transformers.Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref.get_image_features(values[None]).pooler_output[0]
    assert torch.allclose(torch.cat(ours), theirs, atol=1e-5)


def test_one_tile_with_text_around_and_at_the_start(idefics3):
    folder, ref = idefics3
    one = prompt_of([1] + text(0, 5), [FAKE, GLOBAL], tile(0), [FAKE] + text(1, 6))
    first = prompt_of(tile(1), text(2, 7))  # the tile at position 0, no text before it
    results = run_requests(make_engine(folder), [("one", one[0], one[2]), ("first", first[0], first[2])])
    for rid, (ids, pixels, _) in (("one", one), ("first", first)):
        check(results[rid][0][0], ref.greedy(ids, pixels))


def test_an_image_split_into_tiles_and_a_second_image(idefics3):
    """2 x 3 tiles and the global view, then text, then a 1 x 2 image: 10 tiles in one prompt, each its own
    ImageInput, other tokens between them."""
    folder, ref = idefics3
    ids, pixels, images = prompt_of([1] + text(3, 4), *split_image(2, 3, 10), text(4, 5), *split_image(1, 2, 30),
                                    text(5, 3))
    assert len(images) == 10
    check(run_requests(make_engine(folder), [("tiles", ids, images)])["tiles"][0][0], ref.greedy(ids, pixels))


def test_chunked_prefill_splits_tiles(idefics3):
    folder, ref = idefics3
    ids, pixels, images = prompt_of([1] + text(6, 2), *split_image(1, 2, 40), text(7, 2))
    engine = make_engine(folder, max_num_batched_tokens=3)  # 3-token chunks: tiles of 4 split across steps
    assert any(image.offset // 3 != (image.end - 1) // 3 for image in images)
    check(run_requests(engine, [("chunked", ids, images)])["chunked"][0][0], ref.greedy(ids, pixels))


def test_a_prefix_cache_hit_inside_a_tile(idefics3):
    folder, ref = idefics3
    ids, pixels, images = prompt_of([1] + text(8, 14), tile(50), text(9, 6))  # the tile at 15..19
    engine = make_engine(folder, block_size=8)
    expected = ref.greedy(ids, pixels)
    check(run_requests(engine, [("a", ids, images)])["a"][0][0], expected)
    again, cached = run_requests(engine, [("b", ids, images)])["b"]
    assert cached == 24  # blocks 0..2: past the tile
    check(again[0], expected)
    other_ids, other_pixels, other_images = prompt_of([1] + text(8, 14), tile(51), text(9, 6))
    other, cached = run_requests(engine, [("c", other_ids, other_images)])["c"]
    assert cached == 8  # block 1 holds the other tile's first placeholder
    check(other[0], ref.greedy(other_ids, other_pixels))


def test_a_batch_of_text_and_tiles(idefics3):
    folder, ref = idefics3
    plain = [1] + text(10, 12)
    ids, pixels, images = prompt_of([1] + text(11, 3), *split_image(1, 1, 60), text(12, 5))
    results = run_requests(make_engine(folder, max_num_batched_tokens=16),
                           [("text", plain, []), ("image", ids, images)])
    check(results["text"][0][0], ref.greedy(plain, []))
    check(results["image"][0][0], ref.greedy(ids, pixels))


def test_smolvlm(tmp_path):
    """SmolVLMForConditionalGeneration: the same modules and names under SmolVLM's config."""
    from pagedserve.common.model_config import ModelConfig
    arch = "SmolVLMForConditionalGeneration"
    folder = build_tiny_idefics3(tmp_path / "smolvlm", seed=1, arch=arch)
    assert ModelConfig.from_folder(folder).architecture == arch
    ids, pixels, images = prompt_of([1] + text(13, 4), *split_image(1, 2, 70), text(14, 3))
    check(run_requests(make_engine(folder), [("s", ids, images)])["s"][0][0],
          Reference(folder, arch).greedy(ids, pixels))


def test_bfloat16_and_int8_keep_the_tower_float(idefics3):
    """The tower and connector stay plain bfloat16 under the CPU's packed linears and int8 matrices;
    unquantized, the greedy tokens (well separated on these weights) still equal the float32 reference's."""
    from pagedserve.worker.vision.clip import Linear
    folder, ref = idefics3
    ids, pixels, images = prompt_of([1] + text(15, 5), tile(80), text(16, 6))
    for quantization in ("none", "int8"):
        engine = make_engine(folder, dtype="bfloat16", quantization=quantization)
        model = engine.runner.model
        plain = [m for part in (model.vision_model, model.connector) for m in part.modules() if isinstance(m, Linear)]
        assert len(plain) == 3 * 6 + 1 and all(m.weight.dtype == torch.bfloat16 and m.weight.numel() for m in plain)
        tokens = run_requests(engine, [("q", ids, images)])["q"][0][0][0]
        assert len(tokens) == STEPS
        if quantization == "none":
            assert tokens == ref.greedy(ids, pixels)[0]


def test_two_ranks_equal_transformers(idefics3):
    folder, ref = idefics3
    engine = make_engine(folder, tensor_parallel_size=2, max_num_batched_tokens=8)
    image_prompt = prompt_of([1] + text(19, 3), *split_image(1, 2, 100), text(20, 5))
    check_image_and_text(engine, ref, image_prompt, [1] + text(21, 9))


def test_prompt_logprobs_over_tiles_split_in_chunks(idefics3):
    """Every prompt position's logprob, the tiles' placeholders' included, equals transformers'."""
    folder, ref = idefics3
    ids, pixels, images = prompt_of([1] + text(22, 3), *split_image(1, 2, 110), text(23, 4))
    engine = make_engine(folder, max_num_batched_tokens=5)
    with torch.no_grad():
        logits = ref.model(input_ids=torch.tensor([ids]), pixel_values=ref.pixel_values(pixels)).logits[0, :-1]
    check_prompt_logprobs(engine, ids, images, logits)


def test_tiles_that_do_not_fit_are_refused(idefics3):
    folder, _ = idefics3
    ids, _, images = prompt_of([1] + text(17, 3), tile(90), text(18, 2))
    engine = make_engine(folder)
    with pytest.raises(ValueError, match="takes 32x32"):
        engine.add_request("a", ids, GREEDY, images=[image_input(4, PLACEHOLDERS, 16, 16, bytes(16 * 16 * 3))])
    with pytest.raises(ValueError, match="into 4"):
        engine.add_request("b", ids + [IDEFICS3_IMAGE_TOKEN], GREEDY, images=[
            image_input(4, PLACEHOLDERS + 1, IDEFICS3_TILE, IDEFICS3_TILE, images[0].data)])

"""Gemma 3 with images (Gemma3ForConditionalGeneration) on a tiny random model built here (tests/tiny_gemma3.py:
a sliding layer of window 16 and a global one, a SigLIP tower over 56x56 images pooled to 4 rows): the engine's
greedy tokens equal transformers' (float32, its bidirectional image mask from token_type_ids) and its logprobs
agree to 1e-4, with one image, two images with text between, an image at the prompt's start, chunked prefill
(chunks never split an image), a prefix-cache hit inside an image, a batch with a text-only request, bfloat16,
and three checkpoint layouts; the mask matters (transformers' causal-only answer differs by far more than the
tolerance); an image longer than a step is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.common.multimodal import image_input
from tiny_gemma3 import BOI, EOI, IMAGE_SIZE, IMAGE_TOKEN, MM_TOKENS, Reference, build_tiny_gemma3_vl, image
from tiny_models import GREEDY, STEPS, check, check_image_and_text, check_prompt_logprobs, make_engine, run_requests



def text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(1000 + seed).integers(3, 240, n).tolist()


def prompt_of(*parts) -> tuple[list[int], list[np.ndarray], list]:
    """parts: token lists and images, in order -> (prompt ids, the images, their ImageInputs); each image as
    Gemma3Processor lays it out: <start_of_image>, its placeholders, <end_of_image>."""
    ids, pixels, images = [], [], []
    for part in parts:
        if isinstance(part, np.ndarray):
            ids.append(BOI)
            images.append(image_input(len(ids), MM_TOKENS, IMAGE_SIZE, IMAGE_SIZE, part.tobytes()))
            pixels.append(part)
            ids += [IMAGE_TOKEN] * MM_TOKENS + [EOI]
        else:
            ids += part
    return ids, pixels, images


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = build_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3-vl"))
    return folder, Reference(folder)


def test_config_reads_the_vision_half(gemma3):
    from pagedserve.common.model_config import ModelConfig
    cfg = ModelConfig.from_folder(gemma3[0])
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.hidden_size == 64 and cfg.tie_word_embeddings
    v = cfg.vision
    assert (v["text_architecture"], v["image_token_id"], v["boi_token_id"], v["eoi_token_id"]) == \
        ("Gemma3ForCausalLM", IMAGE_TOKEN, BOI, EOI)
    assert (v["num_image_tokens"], v["image_size"], v["bidirectional"]) == (MM_TOKENS, IMAGE_SIZE, True)
    assert cfg.kv_groups().windows == (0, 16)


def test_the_hubs_config_file():
    """gemma-3-4b-it's config.json (text_config names only what differs from Gemma3TextConfig's defaults)."""
    from pagedserve.common.model_config import ModelConfig
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
        "eos_token_id": [1, 106], "image_token_index": 262144, "mm_tokens_per_image": 256, "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                          "patch_size": 14, "vision_use_head": False}})
    assert (cfg.vocab_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads) == (262208, 256, 8, 4)
    assert cfg.tie_word_embeddings and cfg.rope_scaling["rope_type"] == "linear"
    assert (cfg.vision["num_image_tokens"], cfg.vision["image_size"], cfg.vision["patch_size"]) == (256, 896, 14)
    assert cfg.kv_groups().windows[-1] == 1024


def test_one_image_with_text_around_equals_generate(gemma3):
    folder, ref = gemma3
    ids, pixels, images = prompt_of([2] + text(0, 9), image(0), text(1, 8))
    got = run_requests(make_engine(folder), [("one", ids, images)])["one"][0][0]
    check(got, ref.greedy(ids, pixels, STEPS))
    assert got[0] == ref.generate(ids, pixels, STEPS)


def test_the_bidirectional_mask_matters(gemma3):
    """transformers without token_type_ids (a causal mask over the image) answers other logprobs, far past
    the tolerance: the checks here would catch an engine that dropped the mask."""
    _, ref = gemma3
    ids, pixels, _ = prompt_of([2] + text(0, 9), image(0), text(1, 8))
    both = torch.log_softmax(ref.logits(ids, pixels), -1)
    causal = torch.log_softmax(ref.logits(ids, pixels, bidirectional=False), -1)
    assert (both - causal).abs().max() > 1e-2


def test_two_images_and_one_at_the_start(gemma3):
    folder, ref = gemma3
    two = prompt_of([2] + text(2, 5), image(1), text(3, 12), image(2), text(4, 6))  # past the window of 16
    first = prompt_of(image(3), text(5, 7))  # the image's <start_of_image> at position 0
    results = run_requests(make_engine(folder), [("two", two[0], two[2]), ("first", first[0], first[2])])
    for rid, (ids, pixels, _) in (("two", two), ("first", first)):
        check(results[rid][0][0], ref.greedy(ids, pixels, STEPS))


def test_chunked_prefill_keeps_images_whole(gemma3):
    """3-token steps: each image's 4 placeholders go in one step (past the budget where a chunk starts at one)."""
    folder, ref = gemma3
    ids, pixels, images = prompt_of([2] + text(6, 2), image(4), text(7, 3), image(5), text(8, 2))
    engine = make_engine(folder, max_num_batched_tokens=5)
    check(run_requests(engine, [("chunked", ids, images)])["chunked"][0][0], ref.greedy(ids, pixels, STEPS))


def test_prompt_logprobs_in_chunks(gemma3):
    """Every prompt position's logprob, the placeholders' and those right after an image's included."""
    folder, ref = gemma3
    ids, pixels, images = prompt_of([2] + text(9, 3), image(6), text(10, 4), image(7), text(11, 3))
    engine = make_engine(folder, max_num_batched_tokens=6)
    check_prompt_logprobs(engine, ids, images, ref.logits(ids, pixels)[:-1])


def test_a_prefix_cache_hit_inside_an_image(gemma3):
    """Blocks of 8; the image's placeholders at 14..17. A prompt that differs only after the image hits 2 blocks
    (16 tokens), ending inside the image: its step computes the image's last two placeholders, which see the
    cached ones, and the rest. Another image hits 1 block only."""
    folder, ref = gemma3
    ids, pixels, images = prompt_of([2] + text(12, 12), image(8), text(13, 6))
    assert images[0].offset == 14
    engine = make_engine(folder, block_size=8)
    check(run_requests(engine, [("a", ids, images)])["a"][0][0], ref.greedy(ids, pixels, STEPS))
    for rid, parts, hit in (("b", (image(8), text(14, 6)), 16), ("c", (image(9), text(13, 6)), 8)):
        ids, pixels, images = prompt_of([2] + text(12, 12), *parts)
        got, cached = run_requests(engine, [(rid, ids, images)])[rid]
        assert cached == hit
        check(got[0], ref.greedy(ids, pixels, STEPS))


def test_a_batch_of_text_and_images(gemma3):
    folder, ref = gemma3
    plain = [2] + text(14, 20)
    ids, pixels, images = prompt_of([2] + text(15, 3), image(10), text(16, 5))
    results = run_requests(make_engine(folder, max_num_batched_tokens=16),
                           [("text", plain, []), ("image", ids, images)])
    check(results["text"][0][0], ref.greedy(plain, [], STEPS))
    check(results["image"][0][0], ref.greedy(ids, pixels, STEPS))


@pytest.mark.parametrize("renames", [
    (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
     ("multi_modal_projector.", "model.multi_modal_projector.")),  # transformers 5's own names
    (("vision_tower.", "vision_tower.vision_model."),),  # the hub's 4.x names
])
def test_checkpoint_layouts(gemma3, tmp_path, renames):
    folder, ref = gemma3
    other = build_tiny_gemma3_vl(tmp_path / "layout", renames=renames)
    ids, pixels, images = prompt_of([2] + text(17, 4), image(11), text(18, 5))
    check(run_requests(make_engine(other), [("l", ids, images)])["l"][0][0], ref.greedy(ids, pixels, STEPS))


def test_bfloat16(gemma3):
    """bfloat16 weights (tower and projector too): the greedy tokens of the float32 reference."""
    folder, ref = gemma3
    ids, pixels, images = prompt_of([2] + text(19, 5), image(12), text(20, 6))
    engine = make_engine(folder, dtype="bfloat16")
    assert engine.runner.model.multi_modal_projector.mm_input_projection_weight.dtype == torch.bfloat16
    assert run_requests(engine, [("b", ids, images)])["b"][0][0][0] == ref.greedy(ids, pixels, STEPS)[0]


def test_two_ranks(gemma3):
    folder, ref = gemma3
    engine = make_engine(folder, tensor_parallel_size=2, max_num_batched_tokens=8)
    image_prompt = prompt_of([2] + text(23, 3), image(14), text(24, 5), image(15), text(25, 2))
    check_image_and_text(engine, ref, image_prompt, [2] + text(26, 9))


def test_an_image_longer_than_a_step_is_refused(gemma3):
    folder, _ = gemma3
    ids, _, images = prompt_of([2] + text(21, 3), image(13), text(22, 2))
    engine = make_engine(folder, max_num_batched_tokens=3)
    with pytest.raises(ValueError, match="--max-num-batched-tokens is 3"):
        engine.add_request("a", ids, GREEDY, images=images)


def test_a_scheduler_that_splits_an_image_fails_the_request_not_the_step(gemma3):
    """A scheduler without the rule (an older one: whole_images off) splits the image in 5-token steps; the
    worker fails that request alone, naming why (image_rows.unservable)."""
    folder, _ = gemma3
    ids, _, images = prompt_of([2] + text(27, 2), image(16), text(28, 4))  # placeholders 4..7: split at 5
    engine = make_engine(folder, max_num_batched_tokens=5)
    engine.scheduler.config.whole_images = False
    with pytest.raises(RuntimeError, match="split an image across steps"):
        run_requests(engine, [("split", ids, images)])


def test_six_layers_in_gemma3s_pattern(tmp_path):
    """Gemma 3's own pattern (five sliding layers, then a global one: six KV groups), chunked, two images."""
    from pagedserve.common.model_config import ModelConfig
    layers = ("sliding_attention",) * 5 + ("full_attention",)
    folder = build_tiny_gemma3_vl(tmp_path / "six", seed=3, layer_types=layers)
    assert ModelConfig.from_folder(folder).kv_groups().windows == (0,) + (16,) * 5
    ids, pixels, images = prompt_of([2] + text(29, 6), image(17), text(30, 9), image(18), text(31, 3))
    check(run_requests(make_engine(folder, max_num_batched_tokens=7), [("six", ids, images)])["six"][0][0],
          Reference(folder).greedy(ids, pixels, STEPS))


@pytest.mark.parametrize("side, mm_tokens", [(19, 1), (12, 9)])
def test_the_tower_and_projector_equal_transformers(tmp_path, side, mm_tokens):
    """encode_images' rows equal transformers' get_image_features: 19x19 patches (where Idefics3's bucketed
    position ids are not 0..N-1, and SigLIP's are), pooled to one row; 12x12 pooled by 4 to 3x3 rows."""
    folder = build_tiny_gemma3_vl(tmp_path / f"tower{side}", seed=4, mm_tokens=mm_tokens,
                                  vision_overrides={"image_size": side * 2, "patch_size": 2})
    model = make_engine(folder).runner.model
    pics = [np.random.default_rng(k).integers(0, 256, (side * 2, side * 2, 3), dtype=np.uint8) for k in range(3)]
    ours = model.encode_images([image_input(0, mm_tokens, side * 2, side * 2, p.tobytes()) for p in pics])
    x = torch.from_numpy(np.stack(pics)).permute(0, 3, 1, 2).float() * (1 / 255)
    with torch.no_grad():
        theirs = Reference(folder).model.get_image_features((x - 0.5) / 0.5).pooler_output
    assert theirs.shape == (3, mm_tokens, 64)
    assert torch.allclose(torch.stack(ours), theirs, atol=1e-5)


class CountingOps:
    """The compiled CPU kernels as they are, counting the prefill kernel's calls that carry key limits."""

    def __init__(self, ops) -> None:
        self.ops, self.limited = ops, 0

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def paged_prefill_attention(self, *args):
        self.limited += args[-1] is not None
        return self.ops.paged_prefill_attention(*args)


def test_the_compiled_prefill_kernel_computes_the_image_blocks(tmp_path):
    """head_dim 32, a size the CPU's kernels compile in: the steps with images run in the compiled prefill
    kernel with their key limits (not the torch ops), both layers' kinds, whole and in 5-token chunks; greedy
    tokens equal transformers'."""
    from pagedserve.worker.torch_attention import CpuKernelAttentionBackend
    folder = build_tiny_gemma3_vl(tmp_path / "d32", seed=6, head_dim=32)
    ref = Reference(folder)
    ids, pixels, images = prompt_of([2] + text(32, 7), image(19), text(33, 12), image(20), text(34, 4))
    for budget in (None, 5):
        engine = make_engine(folder, **({"max_num_batched_tokens": budget} if budget else {}))
        backends = {id(v): v for m in engine.runner.model.modules() for v in vars(m).values()
                    if isinstance(v, CpuKernelAttentionBackend)}
        if not any(b.prefill_kernel for b in backends.values()):
            pytest.skip("no compiled CPU prefill kernel here (a C++ compiler and AVX-512, or AVX2 with FMA)")
        assert {b.window for b in backends.values()} == {0, 16}
        for backend in backends.values():
            backend.ops = CountingOps(backend.ops)
        check(run_requests(engine, [("d32", ids, images)])["d32"][0][0], ref.greedy(ids, pixels, STEPS))
        # the prompt in one step, or each image's own step, in each layer kind
        assert [b.ops.limited for b in backends.values()] == [1 if budget is None else 2] * 2

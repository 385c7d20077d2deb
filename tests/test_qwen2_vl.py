"""Qwen2-VL and Qwen2.5-VL on tiny random models built here (tiny_qwen2_vl_model.py: towers of 2 and 4 blocks, the
latter with window attention of 56 pixels beside full attention at blocks 1 and 3; a tiny Qwen2 text model
with M-RoPE sections [2, 3, 3]): the engine's greedy tokens equal transformers' generate (float32,
pixel_values and image_grid_thw from Qwen2VLImageProcessorPil without resize) and its logprobs agree to
1e-4, with one image, two of different shapes with text between, an image at the prompt's start, chunked
prefill splitting images across steps, prefix-cache hits ending inside and after an image, decode steps after
(M-RoPE's shift), n = 2 beside a text request, preemption, ngram speculation's verification rows, two
tensor-parallel ranks, bfloat16, both weight layouts, and a request whose image the worker refuses alone."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedserve.common.multimodal import image_input
from pagedserve.common.sampling_params import SamplingParams
from tiny_models import STEPS, check, check_image_and_text, check_preempted, check_prompt_logprobs, \
    check_samples_beside_text, make_engine, run_requests
from tiny_qwen2_vl_model import IMAGE_TOKEN, SECTION, Reference, build_tiny_qwen2_vl, prompt_of, random_image, text



@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    folder = build_tiny_qwen2_vl(tmp_path_factory.mktemp(request.param), request.param)
    return folder, Reference(folder, request.param), request.param


def two_images(seed: int):
    """Text, a 56x84 image (2 x 3 merged patches), text, a 112x56 one (4 x 2), text."""
    return prompt_of([1] + text(seed, 5), random_image(seed, 56, 84), text(seed + 1, 4),
                     random_image(seed + 1, 112, 56), text(seed + 2, 3))


def test_config_reads_the_vision_half(qwen):
    from pagedserve.common.model_config import ModelConfig
    folder, _, family = qwen
    cfg = ModelConfig.from_folder(folder)
    v = cfg.vision
    assert cfg.architecture == ("Qwen2VLForConditionalGeneration" if family == "qwen2_vl"
                                else "Qwen2_5_VLForConditionalGeneration")
    assert v["family"] == family and v["mrope_section"] == SECTION and v["image_token_id"] == IMAGE_TOKEN
    assert v["image_mean"] == (0.5, 0.4, 0.3) and v["image_std"] == (0.2, 0.25, 0.3)
    assert (v["min_pixels"], v["max_pixels"]) == (28 * 28, 224 * 224)


def test_one_image_two_images_and_an_image_first(qwen):
    folder, ref, _ = qwen
    one = prompt_of([1] + text(0, 5), random_image(0, 84, 112), text(1, 6))
    two = two_images(2)
    first = prompt_of(random_image(3, 56, 56), text(5, 7))  # the image at position 0, no text before it
    results = run_requests(make_engine(folder), [("one", one[0], one[2]), ("two", two[0], two[2]),
                                        ("first", first[0], first[2])])
    for rid, (ids, pixels, _) in (("one", one), ("two", two), ("first", first)):
        check(results[rid][0][0], ref.greedy(ids, pixels, STEPS))


def test_chunked_prefill_splits_the_images(qwen):
    folder, ref, _ = qwen
    ids, pixels, images = prompt_of([1] + text(6, 4), random_image(4, 84, 112), text(7, 3),
                                    random_image(5, 112, 56), text(8, 3))
    engine = make_engine(folder, max_num_batched_tokens=5)  # 5-token chunks: 12 and 8 placeholders over steps
    check(run_requests(engine, [("chunked", ids, images)])["chunked"][0][0], ref.greedy(ids, pixels, STEPS))


def test_prefix_cache_hits_inside_and_after_an_image(qwen):
    folder, ref, _ = qwen
    # the image's 24 placeholders at 10..34: a hit of 16 ends inside it, one of 32 too; a longer prompt
    # after it shares 48 tokens: the hit ends past the image, in the text after it
    ids, pixels, images = prompt_of([1] + text(9, 9), random_image(6, 112, 168), text(10, 20))
    longer = ids + text(11, 8)
    expected = ref.greedy(ids, pixels, STEPS)
    engine = make_engine(folder, block_size=16)
    first, _ = run_requests(engine, [("a", ids, images)])["a"]
    check(first[0], expected)
    again, cached = run_requests(engine, [("b", ids, images)])["b"]
    check(again[0], expected)
    assert cached == 48
    inside = prompt_of([1] + text(9, 9), random_image(6, 112, 168))  # ends with the image: 16 and 32 cached
    out, cached = run_requests(engine, [("c", inside[0], inside[2])])["c"]
    assert cached == 32
    check(out[0], ref.forwards(inside[0], inside[1], STEPS))  # (generate's decode positions differ there)
    out, cached = run_requests(engine, [("d", longer, images)])["d"]
    assert cached == 48
    check(out[0], ref.greedy(longer, pixels, STEPS))


@pytest.mark.parametrize("overlap", [False, True])
def test_a_batch_of_text_and_image_requests_and_n_samples(qwen, overlap):
    """...with async scheduling too (a step begun while the one before is in flight: step_overlap.py)."""
    folder, ref, _ = qwen
    plain = [1] + text(12, 12)
    ids, pixels, images = two_images(13)
    engine = make_engine(folder, async_scheduling=overlap, max_num_batched_tokens=16)
    check_samples_beside_text(engine, ref, (ids, pixels, images), plain)


def test_preempted_image_requests_recompute(qwen):
    folder, ref, _ = qwen
    prompts = [prompt_of([1] + text(20 + i, 3 + 5 * i), random_image(20 + i, 56, 56 + 28 * i), text(30 + i, 4))
               for i in range(4)]
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # K/V x layers x tokens x KV heads x head dim x float32
    engine = make_engine(folder, kv_cache_memory=14 * block_bytes, block_size=4, preemption_mode="recompute",
                         max_num_batched_tokens=16)
    check_preempted(engine, ref, prompts, 10)


def test_ngram_speculation_verifies_with_the_shift(qwen):
    """Verification rows (the last token and its proposals, a small prefill run past the prompt) take the
    shifted positions too: the greedy tokens stay transformers'."""
    folder, ref, _ = qwen
    # many of the vocabulary's tokens before and after the image: a token sampled has likely been seen before,
    # and the ngram proposer proposes what followed it
    ids, pixels, images = prompt_of([1] + text(40, 50), random_image(40, 84, 56), text(41, 50))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_by_batch_size": 0}
    engine = make_engine(folder, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = run_requests(engine, [("s", ids, images)], params)["s"][0][0][0]
    assert tokens == ref.greedy(ids, pixels, 16)[0]
    assert engine.stats()["spec_decode"]["num_draft_tokens"] > 0


def test_two_ranks_equal_transformers(qwen):
    folder, ref, _ = qwen
    engine = make_engine(folder, tensor_parallel_size=2, max_num_batched_tokens=16)
    check_image_and_text(engine, ref, two_images(41), [1] + text(44, 9))


def test_bfloat16_keeps_the_greedy_tokens(qwen):
    """The tower runs in bfloat16 beside the text model; the greedy tokens (well separated on these weights)
    still equal the float32 reference's, whole and chunked."""
    folder, ref, _ = qwen
    ids, pixels, images = two_images(50)
    expected = ref.greedy(ids, pixels, STEPS)[0]
    engine = make_engine(folder, dtype="bfloat16")
    assert engine.runner.model.visual.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    assert run_requests(engine, [("q", ids, images)])["q"][0][0][0] == expected
    chunked = make_engine(folder, dtype="bfloat16", max_num_batched_tokens=7)
    assert run_requests(chunked, [("q", ids, images)])["q"][0][0][0] == expected


# what transformers 5.25 saves (the hub's transformers-4 names) -> transformers 5's module names
TRANSFORMERS5 = (("model.", "model.language_model."), ("visual.", "model.visual."))


def test_transformers5_weight_names_load(qwen, tmp_path):
    from safetensors.torch import load_file, save_file
    folder, ref, _ = qwen
    renamed = tmp_path / "transformers5"
    shutil.copytree(folder, renamed)
    saved = load_file(folder / "model.safetensors")
    assert any(n.startswith("model.layers.") for n in saved) and any(n.startswith("visual.") for n in saved)
    new = {}
    for name, tensor in saved.items():
        for prefix, to in TRANSFORMERS5:
            if name.startswith(prefix):
                name = to + name[len(prefix):]
                break
        new[name] = tensor
    assert any(n.startswith("model.language_model.layers.") for n in new) and "lm_head.weight" in new
    save_file(new, renamed / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((renamed / "config.json").read_text())["image_token_id"] == IMAGE_TOKEN
    ids, pixels, images = two_images(60)
    check(run_requests(make_engine(renamed), [("r", ids, images)])["r"][0][0], ref.greedy(ids, pixels, STEPS))


def test_the_worker_fails_a_request_whose_image_it_cannot_take_alone(qwen):
    """A client of the scheduler's gRPC API can skip the front end's checks: a 56x70 image (70 is no multiple
    of 28) fails its request alone and the step's other request runs."""
    from pagedserve.common.messages import NewRequestData, SchedulerOutput
    folder, _, _ = qwen
    ids, _, images = prompt_of([1] + text(90, 3), random_image(90, 56, 56), text(91, 2))
    runner, params = make_engine(folder).runner, SamplingParams(max_tokens=1)
    odd = image_input(images[0].offset, images[0].length, 56, 70, bytes(56 * 70 * 3))
    step = SchedulerOutput(1, [NewRequestData("bad", ids, len(ids), params, [1, 2], 0, images=[odd]),
                               NewRequestData("good", ids, len(ids), params, [3, 4], 0, images=images)],
                           [], {"bad": len(ids), "good": len(ids)})
    out = runner.execute(step)
    assert "multiples of 28" in out.failed["bad"] and "bad" not in out.sampled
    assert list(out.sampled) == ["good"]


def test_the_memory_profile_encodes_the_largest_images_a_step_can_touch(qwen):
    """Dynamic resolution: the largest square image max_pixels allows (224x224: 8 x 8 = 64 rows), as many as a
    step of n tokens meets (n // 64 + 2)."""
    from pagedserve.worker.image_rows import profile_rows
    folder, _, _ = qwen
    runner = make_engine(folder).runner
    rows = profile_rows(runner.model, runner.config.vision, 100)
    assert len(rows) == 100 // 64 + 2 and all(r.shape == (64, 64) for r in rows)


def test_the_tower_encodes_a_batch_as_each_image_alone(qwen):
    """Several images of different shapes in one pass give each one's rows exactly as it alone (no image's
    attention sees another's patches), and equal transformers' image features."""
    folder, ref, _ = qwen
    ids, pixels, images = prompt_of(random_image(70, 56, 84), [5], random_image(71, 112, 56), [6],
                                    random_image(72, 168, 112))
    model = make_engine(folder).runner.model
    together = model.encode_images(images)
    alone = [model.encode_images([image])[0] for image in images]
    inputs = ref.inputs(ids, pixels)
    with torch.no_grad():
        features = ref.model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    for mine, single, theirs, image in zip(together, alone, features, images):
        assert mine.shape == (image.length, 64)
        torch.testing.assert_close(mine, single, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_the_three_sections_rotary_equals_transformers(qwen):
    """The model's rope argument for [3, tokens] positions (plain torch ops: each token's cos and sin rows)
    equals transformers' M-RoPE cos and sin; for [tokens] positions, plain rope."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    from pagedserve.worker.ops import NativeOps
    folder, ref, _ = qwen
    model = make_engine(folder).runner.model
    model.ops = NativeOps()
    positions = torch.randint(0, 200, (3, 11))
    cos, sin = model.rope(positions, torch.float32)
    theirs = Qwen2VLRotaryEmbedding(ref.model.config.text_config)
    their_cos, their_sin = theirs(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    torch.testing.assert_close(cos[:, 0], their_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0], their_sin[0], atol=1e-6, rtol=0)
    plain_cos, _ = model.rope(positions[1], torch.float32)
    same = theirs(torch.zeros(1), positions[1].expand(3, 1, -1))[0][0]
    torch.testing.assert_close(plain_cos[:, 0], same, atol=1e-6, rtol=0)


def test_prompt_logprobs_over_images_split_in_chunks(qwen):
    """Every prompt position's logprob, the images' placeholders' and the shifted text's, equals transformers'
    forward over the whole prompt."""
    folder, ref, _ = qwen
    ids, pixels, images = two_images(70)
    engine = make_engine(folder, max_num_batched_tokens=6)
    with torch.no_grad():
        logits = ref.model(**ref.inputs(ids, pixels)).logits[0, :-1]
    check_prompt_logprobs(engine, ids, images, logits)


def test_only_an_mrope_model_shifts_its_layouts(qwen, tiny_llama):
    """A text model's (and LLaVA's) layouts call no shift: InputBatch.rope_shift stays None."""
    from pagedserve.worker.mrope import PositionShift, position_shift
    folder, _, _ = qwen
    assert isinstance(make_engine(folder).runner.input_batch.rope_shift, PositionShift)
    assert make_engine(tiny_llama).runner.input_batch.rope_shift is None
    assert position_shift({"image_size": 56, "num_image_tokens": 16}) is None and position_shift(None) is None

"""Mistral 3 and Pixtral-in-LLaVA on tiny random models built here (tiny_pixtral_model.py: a Pixtral tower of 2
blocks, Mistral3's projector with its 2x2 patch merger, or LLaVA's over two hidden states; a tiny Mistral text
model): the engine's greedy tokens equal transformers' generate (float32, pixel_values and image_sizes from
PixtralImageProcessorPil without resize) and its logprobs agree to 1e-4, with one image, two of different
shapes with text between, an image at the prompt's start, chunked prefill splitting an image's span (breaks
included) across steps, prefix-cache hits ending inside and after an image, decode after, n = 2 beside a text
request, bfloat16, both weight layouts, the tower's batch and features, and a request whose image span the worker
refuses alone (image_problem's exact check)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedserve.common.multimodal import image_input
from pagedserve.common.sampling_params import SamplingParams
from tiny_models import STEPS, check, check_image_and_text, check_preempted, check_samples_beside_text, make_engine, \
    run_requests
from tiny_pixtral_model import BREAK, END, FACTOR, IMAGE, Reference, build_tiny_pixtral, prompt_of, random_image, \
    text



@pytest.fixture(scope="module", params=["mistral3", "llava"])
def pix(request, tmp_path_factory):
    folder = build_tiny_pixtral(tmp_path_factory.mktemp(request.param), request.param)
    return folder, Reference(folder, request.param), request.param


def two_images(family: str, seed: int):
    """Text, an image of 2 x 3 (merged) patches, text, one of 4 x 2, text."""
    f = FACTOR[family]
    return prompt_of(family, [1] + text(seed, 5), random_image(seed, 2 * f, 3 * f), text(seed + 1, 4),
                     random_image(seed + 1, 4 * f, 2 * f), text(seed + 2, 3))


def test_config_reads_the_vision_half(pix):
    from pagedserve.common.model_config import ModelConfig
    folder, _, family = pix
    cfg = ModelConfig.from_folder(folder)
    v = cfg.vision
    assert cfg.architecture == ("Mistral3ForConditionalGeneration" if family == "mistral3"
                                else "LlavaForConditionalGeneration")
    assert v["family"] == "pixtral" and v["text_architecture"] == "MistralForCausalLM"
    assert (v["image_token_id"], v["image_break_token_id"], v["image_end_token_id"]) == (IMAGE, BREAK, END)
    assert v["patch_size"] * v["merge_size"] == FACTOR[family] and v["max_side"] == 112
    assert v["feature_layers"] == ([2] if family == "mistral3" else [1, 2]) and v["rope_theta"] == 1000.0
    assert v["image_mean"] == (0.5, 0.4, 0.3) and v["image_std"] == (0.2, 0.25, 0.3)
    assert "num_image_tokens" not in v and "min_pixels" not in v and not cfg.tie_word_embeddings


def test_one_image_two_images_and_an_image_first(pix):
    folder, ref, family = pix
    f = FACTOR[family]
    one = prompt_of(family, [1] + text(0, 5), random_image(0, 3 * f, 4 * f), text(1, 6))
    two = two_images(family, 2)
    first = prompt_of(family, random_image(3, 2 * f, 2 * f), text(5, 7))  # the span at position 0
    results = run_requests(make_engine(folder), [("one", one[0], one[2]), ("two", two[0], two[2]),
                                        ("first", first[0], first[2])])
    for rid, (ids, pixels, _) in (("one", one), ("two", two), ("first", first)):
        check(results[rid][0][0], ref.greedy(ids, pixels, STEPS))


@pytest.mark.parametrize("chunk", [3, 5])
def test_chunked_prefill_splits_the_spans(pix, chunk):
    """Chunks of 3 and 5 tokens end inside images' spans, on image tokens and on breaks alike."""
    folder, ref, family = pix
    f = FACTOR[family]
    ids, pixels, images = prompt_of(family, [1] + text(6, 4), random_image(4, 3 * f, 4 * f), text(7, 3),
                                    random_image(5, 4 * f, 2 * f), text(8, 3))
    engine = make_engine(folder, max_num_batched_tokens=chunk)
    check(run_requests(engine, [("chunked", ids, images)])["chunked"][0][0], ref.greedy(ids, pixels, STEPS))


def test_prefix_cache_hits_inside_and_after_an_image(pix):
    folder, ref, family = pix
    f = FACTOR[family]
    # the span (4 rows of 4 + a break: 20 tokens) at 10..30: a prompt that differs from position 30 on shares
    # one block of 16 (the hit ends inside the image); the same prompt again shares 32 (past it)
    head = [1] + text(9, 9)
    image = random_image(6, 4 * f, 4 * f)
    ids, pixels, images = prompt_of(family, head, image, text(10, 20))
    engine = make_engine(folder, block_size=16)
    expected = ref.greedy(ids, pixels, STEPS)
    check(run_requests(engine, [("a", ids, images)])["a"][0][0], expected)
    again, cached = run_requests(engine, [("b", ids, images)])["b"]
    check(again[0], expected)
    assert cached == len(ids) // 16 * 16 and images[0].end < cached
    other = prompt_of(family, head, image, text(11, 20))
    assert other[0][:images[0].end] == ids[:images[0].end] and other[0][images[0].end] != ids[images[0].end]
    out, cached = run_requests(engine, [("c", other[0], other[2])])["c"]
    assert images[0].offset < cached < images[0].end  # the hit ends inside the span
    check(out[0], ref.greedy(other[0], other[1], STEPS))


def test_a_batch_of_text_and_image_requests_and_n_samples(pix):
    folder, ref, family = pix
    plain = [1] + text(12, 12)
    ids, pixels, images = two_images(family, 13)
    engine = make_engine(folder, max_num_batched_tokens=16)
    check_samples_beside_text(engine, ref, (ids, pixels, images), plain)


def test_bfloat16_keeps_the_greedy_tokens(pix):
    """The tower runs in bfloat16 beside the text model; on a prompt whose float32 greedy steps are no near
    ties (every top-2 gap at least 0.08: these tiny weights give small gaps), the tokens stay the reference's,
    whole and chunked."""
    folder, ref, family = pix
    ids, pixels, images = two_images(family, 89)
    assert min(ref.margins(ids, pixels, STEPS)) > 0.08
    expected = ref.greedy(ids, pixels, STEPS)[0]
    engine = make_engine(folder, dtype="bfloat16")
    assert engine.runner.model.vision_tower.transformer.layers[0].attention.q_proj.weight.dtype == torch.bfloat16
    assert run_requests(engine, [("q", ids, images)])["q"][0][0][0] == expected
    chunked = make_engine(folder, dtype="bfloat16", max_num_batched_tokens=7)
    assert run_requests(chunked, [("q", ids, images)])["q"][0][0][0] == expected


# what transformers 5.25 saves (the hub's transformers-4 names) -> transformers 5's module names
TRANSFORMERS5 = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                 ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))


def test_transformers5_weight_names_load(pix, tmp_path):
    from safetensors.torch import load_file, save_file
    folder, ref, family = pix
    renamed = tmp_path / "transformers5"
    shutil.copytree(folder, renamed)
    saved = load_file(folder / "model.safetensors")
    assert any(n.startswith("language_model.model.layers.") for n in saved)
    assert any(n.startswith("vision_tower.transformer.layers.") for n in saved)
    new = {}
    for name, tensor in saved.items():
        prefix, to = next((p, t) for p, t in TRANSFORMERS5 if name.startswith(p))
        new[to + name[len(prefix):]] = tensor
    assert "lm_head.weight" in new and not any(n.startswith(("language_model", "vision_tower")) for n in new)
    save_file(new, renamed / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((renamed / "config.json").read_text())["image_token_index"] == IMAGE
    ids, pixels, images = two_images(family, 60)
    check(run_requests(make_engine(renamed), [("r", ids, images)])["r"][0][0], ref.greedy(ids, pixels, STEPS))


def test_the_tower_encodes_a_batch_as_each_image_alone(pix):
    """Several images of different shapes in one pass give each one's span rows exactly as it alone, the
    projected rows equal transformers' image features at the image tokens, and the break and end rows are
    the text embeddings of those tokens."""
    folder, ref, family = pix
    f = FACTOR[family]
    ids, pixels, images = prompt_of(family, random_image(70, 2 * f, 3 * f), [5], random_image(71, 4 * f, 2 * f),
                                    [6], random_image(72, 3 * f, 3 * f))
    model = make_engine(folder).runner.model
    together = model.encode_images(images)
    alone = [model.encode_images([image])[0] for image in images]
    inputs = ref.inputs(ids, pixels)
    with torch.no_grad():
        features = ref.model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                      image_sizes=inputs["image_sizes"]).pooler_output
        embed = ref.model.get_input_embeddings()
    for mine, single, theirs, image in zip(together, alone, features, images):
        assert mine.shape == (image.length, 64)
        torch.testing.assert_close(mine, single, atol=1e-5, rtol=1e-5)
        span = torch.tensor(ids[image.offset:image.end])
        torch.testing.assert_close(mine[span == IMAGE], theirs, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine[span != IMAGE], embed(span[span != IMAGE]), atol=0, rtol=0)
        assert int((span == END).sum()) == 1 and span[-1] == END


def test_the_worker_fails_a_request_whose_span_it_cannot_take_alone(pix):
    """A client of the scheduler's gRPC API can skip the front end's checks: a span whose break sits one place
    off, and an image whose side is no multiple of the factor, fail their requests alone."""
    from pagedserve.common.messages import NewRequestData, SchedulerOutput
    folder, _, family = pix
    f = FACTOR[family]
    ids, _, images = prompt_of(family, [1] + text(90, 3), random_image(90, 2 * f, 2 * f), text(91, 2))
    moved = list(ids)
    brk = images[0].offset + 2
    assert moved[brk] == BREAK
    moved[brk - 1], moved[brk] = BREAK, IMAGE
    odd = image_input(images[0].offset, images[0].length, 2 * f, 2 * f + 2, bytes(2 * f * (2 * f + 2) * 3))
    runner, params = make_engine(folder).runner, SamplingParams(max_tokens=1)
    step = SchedulerOutput(1, [NewRequestData("moved", moved, len(ids), params, [1, 2], 0, images=images),
                               NewRequestData("odd", ids, len(ids), params, [3, 4], 0, images=[odd]),
                               NewRequestData("good", ids, len(ids), params, [5, 6], 0, images=images)],
                           [], {"moved": len(ids), "odd": len(ids), "good": len(ids)})
    out = runner.execute(step)
    assert "break" in out.failed["moved"] and f"multiples of {f}" in out.failed["odd"]
    assert list(out.sampled) == ["good"]


def test_the_memory_profile_encodes_the_largest_images_a_step_can_touch(pix):
    from pagedserve.worker.image_rows import profile_rows
    folder, _, family = pix
    runner = make_engine(folder).runner
    side = 112 // FACTOR[family]
    rows = profile_rows(runner.model, runner.config.vision, 100)
    per = side * (side + 1)
    assert len(rows) == 100 // per + 2 and all(r.shape == (per, 64) for r in rows)


def test_two_ranks_equal_transformers(pix):
    """Every rank encodes the same images, the break and end rows through the vocabulary-parallel embedding."""
    folder, ref, family = pix
    engine = make_engine(folder, tensor_parallel_size=2, max_num_batched_tokens=16)
    check_image_and_text(engine, ref, two_images(family, 41), [1] + text(44, 9))


def test_preempted_image_requests_recompute(pix):
    folder, ref, family = pix
    f = FACTOR[family]
    prompts = [prompt_of(family, [1] + text(20 + i, 3 + 5 * i), random_image(20 + i, 2 * f, (1 + i) * f),
                         text(30 + i, 4)) for i in range(4)]
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # K/V x layers x tokens x KV heads x head dim x float32
    engine = make_engine(folder, kv_cache_memory=14 * block_bytes, block_size=4, preemption_mode="recompute",
                         max_num_batched_tokens=16)
    check_preempted(engine, ref, prompts, 10)

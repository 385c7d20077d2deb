"""LLaVA on a tiny random model built here (tiny_models.build_tiny_llava: a CLIP tower of 3 layers at
56x56, patches of 14, so 16 placeholder tokens an image; a tiny Llama): the engine's greedy tokens
equal transformers' LlavaForConditionalGeneration (float32, pixel_values from CLIPImageProcessor
without resize or crop) and its logprobs agree to 1e-4, with one image, two, text around them, chunked
prefill splitting an image across steps, prefix-cache hits (one ending inside an image; a different
image breaks the chain at its block), n > 1 samples, a batch with a text-only request, and the
checkpoint's tensors under transformers 5's names as well as the hub's older ones."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from pagedserve.common.multimodal import image_input
from pagedserve.common.sampling_params import SamplingParams
from tiny_models import LLAVA_IMAGE_SIZE, LLAVA_IMAGE_TOKEN, STEPS, build_tiny_llava, check, check_image_and_text, \
    check_preempted, check_prompt_logprobs, check_samples_beside_text, greedy_with_pixels, make_engine, run_requests

PLACEHOLDERS = (LLAVA_IMAGE_SIZE // 14) ** 2


def random_image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE, 3), dtype=np.uint8)


def text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(1000 + seed).integers(3, 250, n).tolist()


def prompt_of(*parts, placeholders: int = PLACEHOLDERS) -> tuple[list[int], list[np.ndarray], list]:
    """parts: token lists and images, in order -> (prompt ids, the images, their ImageInputs)."""
    ids, pixels, images = [], [], []
    for part in parts:
        if isinstance(part, np.ndarray):
            images.append(image_input(len(ids), placeholders, LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE, part.tobytes()))
            pixels.append(part)
            ids += [LLAVA_IMAGE_TOKEN] * placeholders
        else:
            ids += part
    return ids, pixels, images


class Reference:
    """transformers' LLaVA on the folder: greedy tokens and each step's log-softmax, by full forwards."""

    def __init__(self, folder) -> None:
        import transformers
        self.model = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        self.processor = transformers.CLIPImageProcessor.from_pretrained(folder)

    @torch.no_grad()
    def greedy(self, ids: list[int], pixels: list[np.ndarray], steps: int = STEPS):
        values = (self.processor(images=pixels, do_resize=False, do_center_crop=False,
                                 return_tensors="pt").pixel_values if pixels else None)
        return greedy_with_pixels(self.model, ids, values, steps)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = build_tiny_llava(tmp_path_factory.mktemp("llava"))
    return folder, Reference(folder)


def test_config_reads_the_vision_half(llava):
    from pagedserve.common.model_config import ModelConfig
    folder, _ = llava
    cfg = ModelConfig.from_folder(folder)
    assert cfg.architecture == "LlavaForConditionalGeneration" and cfg.hidden_size == 64 and cfg.vocab_size == 256
    v = cfg.vision
    assert v["text_architecture"] == "LlamaForCausalLM" and v["image_token_id"] == LLAVA_IMAGE_TOKEN
    assert v["num_image_tokens"] == PLACEHOLDERS and v["feature_layers"] == [2]  # -2 of 3 layers
    assert v["image_mean"] == (0.5, 0.4, 0.3) and v["image_std"] == (0.2, 0.25, 0.3)


# llava-hf/llava-1.5-7b-hf's config.json (transformers 4.36): the text and vision configs name only what
# differs from transformers' defaults
LLAVA_15 = {"architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
            "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
            "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                            "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                            "torch_dtype": "float16", "vocab_size": 32064},
            "tie_word_embeddings": False, "torch_dtype": "float16",
            "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                              "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                              "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
            "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}


def test_a_llava_15_config_takes_the_defaults_it_leaves_out():
    from pagedserve.common.model_config import ModelConfig
    cfg = ModelConfig.from_hf_dict(LLAVA_15)
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (
        "LlavaForConditionalGeneration", 32064, 4096, 32)
    assert (cfg.intermediate_size, cfg.num_key_value_heads, cfg.max_position_embeddings) == (11008, 32, 4096)
    assert cfg.eos_token_ids == (2,) and not cfg.tie_word_embeddings and cfg.kv_groups().layers == (tuple(range(32)),)
    v = cfg.vision
    assert (v["num_image_tokens"], v["feature_layers"], v["image_token_id"], v["hidden_act"]) == (
        576, [23], 32000, "quick_gelu")
    assert v["image_mean"] == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_hf_dict({**LLAVA_15, "text_config": {"model_type": "gemma"}})


def test_one_image_and_two_with_text_around(llava):
    folder, ref = llava
    one = prompt_of([1] + text(0, 5), random_image(0), text(1, 6))
    two = prompt_of([1] + text(2, 3), random_image(1), text(3, 4), random_image(2), text(4, 2))
    first = prompt_of(random_image(3), text(5, 7))  # the image at position 0, no text before it
    engine = make_engine(folder)
    results = run_requests(engine, [("one", one[0], one[2]), ("two", two[0], two[2]), ("first", first[0], first[2])])
    for rid, (ids, pixels, _) in (("one", one), ("two", two), ("first", first)):
        check(results[rid][0][0], ref.greedy(ids, pixels))


def test_chunked_prefill_splits_an_image(llava):
    folder, ref = llava
    ids, pixels, images = prompt_of([1] + text(6, 4), random_image(4), text(7, 9), random_image(5), text(8, 3))
    engine = make_engine(folder, max_num_batched_tokens=7)  # 7-token chunks: every image over 3 steps
    check(run_requests(engine, [("chunked", ids, images)])["chunked"][0][0], ref.greedy(ids, pixels))


def test_prefix_cache_hits_inside_an_image_and_not_past_another(llava):
    folder, ref = llava
    before, after = [1] + text(9, 19), text(10, 10)  # the image at 20..36: its first placeholder in block 1
    ids, pixels, images = prompt_of(before, random_image(6), after)
    other_ids, other_pixels, other_images = prompt_of(before, random_image(7), after)
    assert other_ids == ids
    engine = make_engine(folder, block_size=16)
    expected = ref.greedy(ids, pixels)
    first, cached = run_requests(engine, [("a", ids, images)])["a"]
    check(first[0], expected)
    hits = engine.stats()["prefix_cache_hits"]
    again, cached = run_requests(engine, [("b", ids, images)])["b"]
    check(again[0], expected)
    assert cached == 32 and engine.stats()["prefix_cache_hits"] > hits  # up to 32: inside the image (20..36)
    other, cached = run_requests(engine, [("c", other_ids, other_images)])["c"]
    assert cached == 16  # block 0 only: block 1 holds the other image's first placeholder
    other_expected = ref.greedy(other_ids, other_pixels)
    check(other[0], other_expected)
    assert other_expected[0] != expected[0]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_batch_of_text_and_image_requests_and_n_samples(llava, overlap):
    """...with async scheduling too (a step begun while the one before is in flight: step_overlap.py)."""
    folder, ref = llava
    plain = [1] + text(11, 12)
    ids, pixels, images = prompt_of([1] + text(12, 3), random_image(8), text(13, 5))
    engine = make_engine(folder, async_scheduling=overlap, max_num_batched_tokens=16)
    assert engine.overlaps == overlap
    check_samples_beside_text(engine, ref, (ids, pixels, images), plain)


# what transformers 5.25 saves (the hub's text names, the tower without vision_model.) -> each layout
LAYOUTS = {
    "transformers5": (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                      ("vision_tower.", "model.vision_tower."),
                      ("multi_modal_projector.", "model.multi_modal_projector.")),
    "hub": (("vision_tower.", "vision_tower.vision_model."),),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_both_weight_layouts_load(llava, tmp_path, layout):
    from safetensors.torch import load_file, save_file
    folder, ref = llava
    renamed = tmp_path / layout
    shutil.copytree(folder, renamed)
    saved = load_file(folder / "model.safetensors")
    assert any(name.startswith("language_model.model.") for name in saved)
    new = {}
    for name, tensor in saved.items():
        for prefix, to in LAYOUTS[layout]:
            if name.startswith(prefix):
                name = to + name[len(prefix):]
                break
        new[name] = tensor
    save_file(new, renamed / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((renamed / "config.json").read_text())["architectures"] == ["LlavaForConditionalGeneration"]
    ids, pixels, images = prompt_of([1] + text(14, 4), random_image(9), text(15, 4))
    check(run_requests(make_engine(renamed), [("r", ids, images)])["r"][0][0], ref.greedy(ids, pixels))


def test_a_one_token_step_on_an_image_skips_the_decode_graphs(llava):
    """A prefix-cache hit of 32 of 33 tokens leaves one scheduled token, the image's last placeholder: a
    one-row step that a decode graph would take (it would embed the token id) runs eagerly with its row."""
    from pagedserve.worker.graph_runner import StandInGraph
    folder, ref = llava
    ids, pixels, images = prompt_of([1] + text(16, 16), random_image(10))  # the image at 17..33: last in the prompt
    engine = make_engine(folder, max_num_seqs=8, block_size=16)
    engine.runner.enable_decode_graphs(8, StandInGraph)
    expected = ref.greedy(ids, pixels)
    first, _ = run_requests(engine, [("a", ids, images)])["a"]
    again, cached = run_requests(engine, [("b", ids, images)])["b"]
    assert cached == 32
    check(first[0], expected)
    check(again[0], expected)
    assert sum(g.replays for g in engine.runner.decode_graphs.graphs.values()) > 0  # text decodes still replay


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_image_requests_match(llava, mode):
    folder, ref = llava
    prompts = [prompt_of([1] + text(20 + i, 3 + 5 * i), random_image(20 + i), text(30 + i, 4)) for i in range(4)]
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # K/V x layers x tokens x KV heads x head dim x float32
    engine = make_engine(folder, kv_cache_memory=18 * block_bytes, block_size=4, preemption_mode=mode,
                         swap_space=64 * block_bytes, max_num_batched_tokens=16)
    check_preempted(engine, ref, prompts, STEPS)


def test_two_ranks_equal_transformers(llava):
    folder, ref = llava
    engine = make_engine(folder, tensor_parallel_size=2, max_num_batched_tokens=16)
    check_image_and_text(engine, ref, prompt_of([1] + text(40, 5), random_image(40), text(41, 6)), [1] + text(42, 9))


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_bfloat16_and_int8_keep_the_tower_float(llava, quantization):
    """The CPU's packed bfloat16 linears and int8 matrices are the text model's; the tower and projector stay
    plain bfloat16. Unquantized, the greedy tokens (well separated on these weights) still equal the float32
    reference's; int8 moves the text model's logits, so there whole and chunked prefill agree."""
    from pagedserve.worker.vision.clip import Linear
    folder, ref = llava
    ids, pixels, images = prompt_of([1] + text(50, 5), random_image(50), text(51, 6))
    engine = make_engine(folder, dtype="bfloat16", quantization=quantization)
    model = engine.runner.model
    plain = [m for part in (model.vision_tower, model.multi_modal_projector) for m in part.modules()
             if isinstance(m, Linear)]
    assert len(plain) == 2 * 6 + 2 and all(m.weight.dtype == torch.bfloat16 and m.weight.numel() for m in plain)
    tokens = run_requests(engine, [("q", ids, images)])["q"][0][0][0]
    if quantization == "none":
        assert tokens == ref.greedy(ids, pixels)[0]
    else:
        chunked = make_engine(folder, dtype="bfloat16", quantization=quantization, max_num_batched_tokens=7)
        assert run_requests(chunked, [("q", ids, images)])["q"][0][0][0] == tokens


def test_prompt_logprobs_over_an_image_split_in_chunks(llava):
    """Every prompt position's logprob, the image's placeholders' included, equals transformers'."""
    folder, ref = llava
    ids, pixels, images = prompt_of([1] + text(70, 6), random_image(70), text(71, 5))
    engine = make_engine(folder, max_num_batched_tokens=8)
    values = ref.processor(images=pixels, do_resize=False, do_center_crop=False, return_tensors="pt").pixel_values
    with torch.no_grad():
        logits = ref.model(input_ids=torch.tensor([ids]), pixel_values=values).logits[0, :-1]
    check_prompt_logprobs(engine, ids, images, logits)


def test_images_that_do_not_fit_the_model_are_refused(llava, tmp_path):
    from tiny_models import build_tiny_model
    folder, _ = llava
    ids, _, images = prompt_of([1] + text(80, 3), random_image(80), text(81, 2))
    engine = make_engine(folder)
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match="not all the image token"):
        engine.add_request("a", ids[:5] + [7] + ids[6:], params, images=images)
    small = image_input(images[0].offset, PLACEHOLDERS, 28, 28, bytes(28 * 28 * 3))
    with pytest.raises(ValueError, match="takes 56x56"):
        engine.add_request("b", ids, params, images=[small])
    with pytest.raises(ValueError, match="into 16"):
        engine.add_request("c", ids + [LLAVA_IMAGE_TOKEN], params, images=[
            image_input(images[0].offset, PLACEHOLDERS + 1, LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE, images[0].data)])
    with pytest.raises(ValueError, match="takes no images"):
        make_engine(build_tiny_model(tmp_path / "llama")).add_request("d", ids, params, images=images)


def test_a_qwen2_llava_with_two_feature_layers_and_the_class_row(tmp_path):
    """Qwen2 text (q/k/v biases), vision_feature_layer [-3, -1] concatenated, strategy "full": 17 rows an image."""
    from pagedserve.common.model_config import ModelConfig
    folder = build_tiny_llava(tmp_path / "qwen2", seed=1, text_arch="qwen2", vision_feature_layer=[-3, -1],
                              vision_feature_select_strategy="full", projector_hidden_act="gelu_pytorch_tanh")
    vision = ModelConfig.from_folder(folder).vision
    assert vision["feature_layers"] == [1, 3] and vision["num_image_tokens"] == PLACEHOLDERS + 1
    ref = Reference(folder)
    ids, pixels, images = prompt_of([1] + text(90, 4), random_image(90), text(91, 5), placeholders=PLACEHOLDERS + 1)
    check(run_requests(make_engine(folder), [("q", ids, images)])["q"][0][0], ref.greedy(ids, pixels))


def test_the_worker_fails_a_request_whose_images_it_cannot_take_alone(llava):
    """A client of the scheduler's gRPC API can skip the front end's checks: the worker then fails that
    request alone (ModelRunnerOutput.failed) and runs the others of the step."""
    from pagedserve.common.messages import NewRequestData, SchedulerOutput
    folder, _ = llava
    ids, _, images = prompt_of([1] + text(90, 3), random_image(90), text(91, 2))
    engine = make_engine(folder)
    runner, params = engine.runner, SamplingParams(max_tokens=1)
    small = image_input(images[0].offset, PLACEHOLDERS, 28, 28, bytes(28 * 28 * 3))
    step = SchedulerOutput(1, [NewRequestData("bad", ids, len(ids), params, [1, 2], 0, images=[small]),
                               NewRequestData("good", ids, len(ids), params, [3, 4], 0, images=images)],
                           [], {"bad": len(ids), "good": len(ids)})
    out = runner.execute(step)
    assert "takes 56x56" in out.failed["bad"] and "bad" not in out.sampled
    assert list(out.sampled) == ["good"]


def test_the_memory_profile_encodes_as_many_images_as_a_step_can_touch(llava):
    """A step of n tokens meets at most n // rows + 2 images (partly at both ends): the CUDA memory
    profile (model_runner._profile_peak) runs that many through the tower, their rows alive over the
    forward; none for a text model."""
    from pagedserve.worker.image_rows import profile_rows
    folder, _ = llava
    runner = make_engine(folder).runner
    rows = profile_rows(runner.model, runner.config.vision, 40)
    assert len(rows) == 40 // PLACEHOLDERS + 2
    assert all(r.shape == (PLACEHOLDERS, runner.config.hidden_size) for r in rows)
    assert profile_rows(runner.model, None, 40) is None

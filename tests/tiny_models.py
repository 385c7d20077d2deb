"""Tiny random-weight HF models, built and saved by the tests themselves, an engine over a model, and what the
vision-language models' tests share: running requests with images through the engine, checking its greedy
tokens, logprobs and prompt logprobs against transformers'."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.common.sampling_params import SamplingParams


def sharpen(model, norm_mean: float | None = None, norm_std: float = 0.2) -> None:
    """Random init gives near-uniform logits; sharper weights make greedy choices well separated. Matrices
    N(0, 0.15), biases N(0, 0.1), norm weights N(norm_mean, norm_std) when norm_mean is given."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15)
            elif "bias" in name:
                param.normal_(0.0, 0.1)
            elif norm_mean is not None and "norm" in name:
                param.normal_(norm_mean, norm_std)


@torch.no_grad()
def generate_greedy(model, inputs: dict, steps: int) -> tuple[list[int], list[float]]:
    """transformers' generate on inputs (input_ids and the rest): exactly `steps` greedy tokens (no eos) and
    each one's logprob from generate's logits."""
    gen = model.generate(**inputs, max_new_tokens=steps, do_sample=False, min_new_tokens=steps, eos_token_id=None,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = gen.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1)[t].item() for step, t in zip(gen.logits, tokens)]
    return tokens, logprobs


@torch.no_grad()
def greedy_with_pixels(model, ids: list[int], pixel_values, steps: int) -> tuple[list[int], list[float]]:
    """A transformers vision-language model's greedy tokens and their logprobs, by full forwards."""
    ids, tokens, logprobs = list(ids), [], []
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([ids]), pixel_values=pixel_values).logits[0, -1]
        lp = torch.log_softmax(logits.float(), dim=-1)
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(lp[token].item())
        ids.append(token)
    return tokens, logprobs


def build_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random model (config.json + model.safetensors) into folder and return it."""
    import transformers

    if arch == "llava":
        return build_tiny_llava(folder, seed, **overrides)
    if arch == "idefics3":
        return build_tiny_idefics3(folder, seed, **overrides)
    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common.update(overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(tie_word_embeddings=False, **common)
        model = transformers.MistralForCausalLM(cfg)
    elif arch == "mixtral":
        common = {**dict(num_local_experts=4, num_experts_per_tok=2), **common}
        cfg = transformers.MixtralConfig(tie_word_embeddings=False, **common)
        model = transformers.MixtralForCausalLM(cfg)
    elif arch == "qwen2_moe":
        common = {**dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=96, norm_topk_prob=False), **common}
        cfg = transformers.Qwen2MoeConfig(tie_word_embeddings=False, **common)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    elif arch == "qwen3":
        common = {**dict(head_dim=16), **common}
        cfg = transformers.Qwen3Config(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif arch == "qwen3_moe":
        # The first layer dense (mlp_only_layers), the others MoE; no shared expert.
        common = {**dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         mlp_only_layers=[0], norm_topk_prob=True), **common}
        cfg = transformers.Qwen3MoeConfig(tie_word_embeddings=False, **common)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif arch == "phi3":
        cfg = transformers.Phi3Config(tie_word_embeddings=False, **common)
        model = transformers.Phi3ForCausalLM(cfg)
    elif arch == "smollm3":
        # NoPE every second layer of four (no_rope_layer_interval 2): layers 1 and 3 take no rotary
        common = {**common, **dict(num_hidden_layers=4, no_rope_layer_interval=2), **overrides}
        cfg = transformers.SmolLM3Config(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
        model = transformers.SmolLM3ForCausalLM(cfg)
    elif arch == "granite":
        # Granite 3's multipliers, away from 1 so that each one shows
        common = {**common, **dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                                   logits_scaling=8.0), **overrides}
        cfg = transformers.GraniteConfig(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
        model = transformers.GraniteForCausalLM(cfg)
    elif arch in ("deepseek_v3", "deepseek_v2"):
        # Multi-head latent attention (q and kv compressed), the first layer dense, then MoE
        # with shared experts and group-limited routing. MLA has as many KV heads as query heads
        # (transformers repeats kv_b_proj's heads by num_attention_heads // num_key_value_heads).
        common = {**common, **dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8,
                                   num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, n_group=4,
                                   topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
                                   qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24), **overrides}
        if "num_key_value_heads" not in overrides:
            common["num_key_value_heads"] = common["num_attention_heads"]
        if arch == "deepseek_v3":
            cfg = transformers.DeepseekV3Config(tie_word_embeddings=False, **common)
            model = transformers.DeepseekV3ForCausalLM(cfg)
        else:
            common.setdefault("topk_method", "group_limited_greedy")
            cfg = transformers.DeepseekV2Config(tie_word_embeddings=False, **common)
            model = transformers.DeepseekV2ForCausalLM(cfg)
    elif arch == "gemma3":
        # Local and global layers interleaved (pattern 2: layers 0, 2 local; 1, 3 global), a
        # window shorter than most test prompts, distinct rope bases.
        common = {**common, **dict(num_hidden_layers=4, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                                   layer_types=["sliding_attention", "full_attention"] * 2,
                                   rope_parameters={
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
                  **overrides}
        cfg = transformers.Gemma3TextConfig(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
        model = transformers.Gemma3ForCausalLM(cfg)
    elif arch == "cohere":
        # q/k norms per head on, a logit scale away from 1 (Command-R's 0.0625 would flatten these logits)
        common = {**common, **dict(use_qk_norm=True, logit_scale=0.5, layer_norm_eps=1e-5), **overrides}
        cfg = transformers.CohereConfig(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
        model = transformers.CohereForCausalLM(cfg)
    elif arch == "cohere2":
        # three local layers (a window of 8) to one global (NoPE) layer, a logit scale away from 1
        common = {**common, **dict(num_hidden_layers=4, sliding_window=8, logit_scale=0.5), **overrides}
        cfg = transformers.Cohere2Config(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
        model = transformers.Cohere2ForCausalLM(cfg)
    elif arch == "starcoder2":
        common = {k: v for k, v in common.items() if k != "rms_norm_eps"}
        common = {**common, **dict(norm_epsilon=1e-5, use_bias=True), **overrides}
        cfg = transformers.Starcoder2Config(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
        model = transformers.Starcoder2ForCausalLM(cfg)
    elif arch == "olmo2":
        common = {**common, **overrides}
        cfg = transformers.Olmo2Config(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
        model = transformers.Olmo2ForCausalLM(cfg)
    elif arch == "gemma2":
        # Gemma 3's shape without q/k norms, one rope base; soft-capping small enough to bend these
        # random weights' scores and logits (the real model's 50 and 30 would hardly touch them).
        common = {**common, **dict(num_hidden_layers=4, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                                   attn_logit_softcapping=1.5, final_logit_softcapping=4.0), **overrides}
        cfg = transformers.Gemma2Config(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
        model = transformers.Gemma2ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    if arch in ("gemma2", "gemma3"):  # zero-centred (1 + w) norms: vary them too
        sharpen(model, norm_mean=0.0, norm_std=0.5)
    elif arch in ("olmo2", "cohere", "cohere2", "starcoder2"):  # vary the norms too
        sharpen(model, norm_mean=1.0, norm_std=0.3)
    else:
        sharpen(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's load-balancing bias
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


LLAVA_IMAGE_TOKEN = 255  # the tiny LLaVA's image token: inside the tiny vocabulary
LLAVA_IMAGE_SIZE = 56  # (56 / 14)^2 = 16 patches: 16 placeholder tokens per image


def build_tiny_llava(folder: Path, seed: int = 0, text_arch: str = "llama", vision_overrides: dict | None = None,
                     **llava_overrides) -> Path:
    """A tiny LLaVA (llava-1.5 layout: CLIP tower, 2-layer projector, a tiny Llama (or text_arch "qwen2") of the
    vocabulary above) with its preprocessor_config.json (non-CLIP mean and std, so that the worker must read
    them). llava_overrides: LlavaConfig's own fields (vision_feature_layer, vision_feature_select_strategy...)."""
    import transformers

    torch.manual_seed(seed)
    vision = transformers.CLIPVisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        image_size=LLAVA_IMAGE_SIZE, patch_size=14, hidden_act="quick_gelu", layer_norm_eps=1e-5),
        **(vision_overrides or {})})
    text_config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[text_arch]
    text = text_config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, **{**dict(
        image_token_index=LLAVA_IMAGE_TOKEN, vision_feature_layer=-2, image_seq_length=(LLAVA_IMAGE_SIZE // 14) ** 2),
        **llava_overrides})
    model = transformers.LlavaForConditionalGeneration(cfg)
    sharpen(model, norm_mean=1.0, norm_std=0.2)
    model.save_pretrained(folder, safe_serialization=True)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": LLAVA_IMAGE_SIZE}, crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE},
        image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3]).save_pretrained(folder)
    return folder


IDEFICS3_IMAGE_TOKEN = 255  # the tiny Idefics3's image token: inside the tiny vocabulary
IDEFICS3_TILE = 32  # tiles of 32x32: (32 / 8)^2 = 16 patches, shuffled by 2: 4 placeholder tokens a tile


def build_tiny_idefics3(folder: Path, seed: int = 0, arch: str = "Idefics3ForConditionalGeneration",
                        vision_overrides: dict | None = None, **overrides) -> Path:
    """A tiny Idefics3 (or arch "SmolVLMForConditionalGeneration": the same modules under SmolVLM's
    config): a SigLIP tower of 3 layers over 32x32 tiles, patches of 8, the connector's pixel shuffle by 2,
    a tiny Llama of the vocabulary above; with its image processor's preprocessor_config.json (tiles of
    max_image_size, as the hub's are the tower's image_size; a mean and std other than the 0.5 defaults,
    so that the worker must read them)."""
    import transformers

    torch.manual_seed(seed)
    vision = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                     image_size=IDEFICS3_TILE, patch_size=8), **(vision_overrides or {})}
    text = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config_class = {"Idefics3ForConditionalGeneration": transformers.Idefics3Config,
                    "SmolVLMForConditionalGeneration": transformers.SmolVLMConfig}[arch]
    model_class = getattr(transformers, arch)
    cfg = config_class(vision_config=vision, text_config=text,
                       **{**dict(image_token_id=IDEFICS3_IMAGE_TOKEN, scale_factor=2), **overrides})
    model = model_class(cfg)
    sharpen(model, norm_mean=1.0, norm_std=0.2)
    model.save_pretrained(folder, safe_serialization=True)
    processor = getattr(transformers, arch.replace("ForConditionalGeneration", "ImageProcessorPil"))
    processor(image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3], size={"longest_edge": 4 * IDEFICS3_TILE},
              max_image_size={"longest_edge": IDEFICS3_TILE}).save_pretrained(folder)
    return folder


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own generate, one prompt at a time (no padding): the reference."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # ignore_eos, without min_new_tokens' eos masking
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        outs.append(gen[0, len(prompt):].tolist())
    return outs


class NoTokenizer:
    """Tiny test models have no tokenizer; the engine only needs its eos id."""
    eos_token_id = None


NO_TOKENIZER = NoTokenizer()


def make_engine(model: Path, tokenizer=NO_TOKENIZER, **overrides):
    """A float32 engine on `model` with its weights dequantized (what transformers computes);
    tokenizer=None loads the model's own."""
    from pagedserve.engine import EngineConfig, LLMEngine
    cfg = dict(model=str(model), dtype="float32", quantization="none", progress=False, kv_cache_memory="64MiB")
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg), tokenizer=tokenizer)


def check_logprobs_equal_transformers(folder: Path, prompt: list[int], steps: int = 4, top: int = 2, **overrides):
    """The engine's greedy logprobs (the sampled token's and the top `top`) over `steps` tokens equal
    transformers' log_softmax on the same weights to 1e-4 (what greedy tokens alone cannot show: a
    scale or a cap on the logits); returns the engine's sample."""
    import pytest
    import transformers

    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=top)
    with make_engine(folder, **overrides) as engine:
        out = engine.generate([prompt], params)[0][0]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1], dim=-1)
    for step, sample in enumerate(out.logprobs):
        assert sample.logprob == pytest.approx(ref[step, sample.token_id].item(), abs=1e-4)
        assert [lp for _, lp in sample.top_logprobs] == pytest.approx(ref[step].topk(top).values.tolist(), abs=1e-4)
    return out


STEPS = 6  # the vision-language tests' greedy length
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=1)


def run_requests(engine, requests, params=GREEDY) -> dict:
    """requests: (id, prompt ids, ImageInputs) -> id -> (per sample: (tokens, logprobs)), cached tokens)."""
    samples = {rid: {} for rid, _, _ in requests}
    cached = {}
    for rid, ids, images in requests:
        engine.add_request(rid, ids, params, images=images)
    while engine.has_unfinished():
        for out in engine.step():
            tokens, lps = samples[out.request_id].setdefault(out.sample_index, ([], []))
            tokens += [t.token_id for t in out.new_tokens]
            lps += [t.logprob for t in out.new_tokens]
            cached[out.request_id] = out.num_cached_tokens
    return {rid: ([samples[rid][i] for i in sorted(samples[rid])], cached.get(rid, 0)) for rid in samples}


def check(result, expected) -> None:
    """A sample's (tokens, logprobs) equal the expected tokens, the logprobs to 1e-4."""
    import pytest

    tokens, logprobs = result
    assert tokens == expected[0]
    assert logprobs == pytest.approx(expected[1], abs=1e-4)


def check_prompt_logprobs(engine, ids: list[int], images: list, logits: torch.Tensor) -> None:
    """The engine's prompt logprobs of ids (one token to generate) equal the log-softmax of transformers'
    logits (one row per prompt position but the last) at each next token, to 1e-4."""
    import pytest

    engine.add_request("p", ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), images=images)
    got = None
    while engine.has_unfinished():
        for out in engine.step():
            got = out.prompt_logprobs if out.prompt_logprobs is not None else got
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert [t.token_id for t in got] == ids[1:]
    assert [t.logprob for t in got] == pytest.approx(expected, abs=1e-4)


def check_samples_beside_text(engine, ref, image_prompt, plain: list[int]) -> None:
    """A text request and an image one (image_prompt: (ids, pixels, ImageInputs)), n = 2 each, through the engine:
    both of the image's samples and every text sample equal ref.greedy's tokens and logprobs."""
    ids, pixels, images = image_prompt
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=1, n=2)
    results = run_requests(engine, [("text", plain, []), ("image", ids, images)], params)
    for sample in results["text"][0]:
        check(sample, ref.greedy(plain, [], STEPS))
    assert len(results["image"][0]) == 2
    for sample in results["image"][0]:  # (an M-RoPE fork's second sample decodes with its parent's shift)
        check(sample, ref.greedy(ids, pixels, STEPS))


def check_image_and_text(engine, ref, image_prompt, plain: list[int]) -> None:
    """An image request (image_prompt: (ids, pixels, ImageInputs)) beside a text one through the engine, closed
    after: each one's greedy tokens and logprobs equal ref.greedy's."""
    ids, pixels, images = image_prompt
    with engine:
        results = run_requests(engine, [("image", ids, images), ("text", plain, [])])
    check(results["image"][0][0], ref.greedy(ids, pixels, STEPS))
    check(results["text"][0][0], ref.greedy(plain, [], STEPS))


def check_preempted(engine, ref, prompts: list, steps: int) -> None:
    """prompts ((ids, pixels, ImageInputs) each) through an engine whose KV cache cannot hold them all: it preempts,
    and each request's `steps` greedy tokens and logprobs equal ref.greedy's."""
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=1)
    results = run_requests(engine, [(f"p{i}", ids, images) for i, (ids, _, images) in enumerate(prompts)], params)
    assert engine.stats()["num_preemptions"] > 0
    for i, (ids, pixels, _) in enumerate(prompts):
        check(results[f"p{i}"][0][0], ref.greedy(ids, pixels, steps))

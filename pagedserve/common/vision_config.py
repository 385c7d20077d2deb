"""A vision-language config.json read into its two halves: the text model's config (a plain causal
LM's dict, which ModelConfig reads as it reads any other) and the vision settings the worker's
vision tower and projector need (`vision`, a plain dict; ModelConfig.vision).

LLaVA (LlavaForConditionalGeneration, llava-1.5 style): a CLIP vision tower, a 2-layer MLP projector,
a Llama / Mistral / Qwen2 text model. Older hub files leave transformers' defaults out (a llava-1.5
text_config of a few keys, a vision_config without its CLIP-L/336 shape): those defaults are filled in
here. Each image of a prompt becomes `num_image_tokens` rows: (image_size / patch_size)^2 patches, plus
the class row with vision_feature_select_strategy "full". The front end puts that many copies of
`image_token_id` in the prompt for each image (common/multimodal.py).

Pixtral's family (Mistral3ForConditionalGeneration, and LLaVA whose vision_config.model_type is "pixtral"):
pixtral_config.py, its vision settings' family "pixtral"; an image's ImageInput covers its whole span of
[IMG] rows with their [IMG_BREAK] / [IMG_END] tokens, which image_problem checks exactly.

No torch: the gateway, tokenizer and scheduler read ModelConfig too.
"""

from __future__ import annotations

from pagedserve.common.pixtral_config import is_pixtral, pixtral_parts, span_problem

IDEFICS3_ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
QWEN2_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
GEMMA3_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
VISION_ARCHITECTURES = ("LlavaForConditionalGeneration", *IDEFICS3_ARCHITECTURES, *QWEN2_VL_ARCHITECTURES,
                        *GEMMA3_ARCHITECTURES, "Mistral3ForConditionalGeneration")
# text_config model_type -> the causal LM architecture that serves it inside a LLaVA
TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# transformers' LlamaConfig defaults, for a llava-1.5 text_config that names only what differs
LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
                      bos_token_id=1, eos_token_id=2)
# LlavaConfig's vision_config defaults (CLIP ViT-L/14 at 336) and CLIPVisionConfig's
CLIP_DEFAULTS = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                     image_size=336, patch_size=14, num_channels=3, hidden_act="quick_gelu", layer_norm_eps=1e-5)
# CLIPImageProcessor's normalization defaults (OpenAI CLIP's), when the folder has no preprocessor_config.json
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# Idefics3VisionConfig's defaults (a SigLIP tower) and Idefics3ImageProcessor's normalization
SIGLIP_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                       image_size=224, patch_size=32, num_channels=3, hidden_act="gelu_pytorch_tanh",
                       layer_norm_eps=1e-6)
HALF = (0.5, 0.5, 0.5)


def vision_parts(cfg: dict) -> tuple[dict, dict] | None:
    """(the text model's config dict, the vision settings) of a vision-language config.json, or None
    for a text model. The vision settings every such model has: architecture, text_architecture,
    image_token_id, num_image_tokens (rows per image: each image a prompt holds, or each tile of one,
    arrives as image_size x image_size pixels over that many placeholders), image_size, and the tower's
    normalization (rescale_factor, image_mean, image_std)."""
    archs = set(cfg.get("architectures") or ())
    if archs & set(GEMMA3_ARCHITECTURES):
        return gemma3_parts(cfg)
    if is_pixtral(cfg):  # Mistral3, or LLaVA over a Pixtral tower (pixtral_config.py)
        return pixtral_parts(cfg, _text_half)
    if archs & set(QWEN2_VL_ARCHITECTURES):
        return qwen2_vl_parts(cfg)
    if archs & set(IDEFICS3_ARCHITECTURES):
        return idefics3_parts(cfg)
    if "LlavaForConditionalGeneration" in archs:
        return llava_parts(cfg)
    return None


def _text_half(cfg: dict, defaults: dict = LLAMA_DEFAULTS) -> dict:
    """The text model's config dict with its `architectures` (a LLaVA's or an Idefics3's text_config)."""
    text = dict(cfg.get("text_config") or {"model_type": "llama"})
    model_type = text.get("model_type", "llama")
    arch = next((a for a in text.get("architectures") or [] if a in TEXT_ARCHITECTURES.values()), None)
    arch = arch or TEXT_ARCHITECTURES.get(model_type)
    if arch is None:
        raise ValueError(f"a {model_type!r} text model is not supported in a vision-language model; supported: "
                         f"{', '.join(TEXT_ARCHITECTURES)}")
    text["architectures"] = [arch]
    if model_type == "llama":
        for key, value in defaults.items():
            text.setdefault(key, value)
    for key in ("tie_word_embeddings", "quantization_config"):  # the model's own, at the top level
        if key in cfg:
            text[key] = cfg[key]
    return text


TOWER_KEYS = ("image_size", "patch_size", "num_channels", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "hidden_act", "layer_norm_eps")


def tower_fields(tower: dict) -> dict:
    """A ViT's settings as the worker's towers read them (a SigLIP's or a CLIP's vision_config, defaults filled)."""
    return {key: tower[key] for key in TOWER_KEYS}


def idefics3_parts(cfg: dict) -> tuple[dict, dict]:
    """Idefics3 / SmolVLM: a SigLIP tower over image_size tiles (no class row), the connector's pixel
    shuffle (scale_factor^2 patches into one row) and projection, a Llama text model. Each tile (the
    processor splits a large image into tiles, plus a global view) takes (image_size / patch_size)^2 /
    scale_factor^2 rows."""
    text = _text_half(cfg, {**LLAMA_DEFAULTS, "rms_norm_eps": 1e-5})  # Idefics3Config's text default
    # transformers ties the LM head by Idefics3Config's (SmolVLMConfig's) own flag, False when absent,
    # whatever text_config says
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    siglip = {**SIGLIP_DEFAULTS, **(cfg.get("vision_config") or {})}
    scale = int(cfg.get("scale_factor", 2))
    side = siglip["image_size"] // siglip["patch_size"]
    if side % scale:
        raise ValueError(f"scale_factor {scale} does not divide the tower's {side}x{side} patches")
    vision = dict(
        architecture=next(a for a in cfg["architectures"] if a in IDEFICS3_ARCHITECTURES),
        text_architecture=text["architectures"][0],
        image_token_id=int(cfg.get("image_token_id", 128257)),
        num_image_tokens=side * side // (scale * scale),
        scale_factor=scale,
        **tower_fields(siglip),
        rescale_factor=1 / 255, image_mean=HALF, image_std=HALF,  # Idefics3ImageProcessor's defaults
    )
    return text, vision


# Qwen2VLImageProcessor's defaults: pixels per image (min_pixels, max_pixels) and OpenAI CLIP's normalization
QWEN2_VL_MIN_PIXELS, QWEN2_VL_MAX_PIXELS = 56 * 56, 28 * 28 * 1280


def qwen2_vl_parts(cfg: dict) -> tuple[dict, dict]:
    """Qwen2-VL and Qwen2.5-VL: a ViT over 14x14 patches of an image at its own (dynamic) resolution, 2x2
    patches merged into one row, a Qwen2 text model whose rotary is M-RoPE (each rotary frequency section
    turns by a temporal, a height or a width position: an image's rows by their place in its grid, text by
    its index, shifted past each image by what its grid saves; mrope_section).

    An image arrives resized to height x width, both multiples of patch_size * merge_size (the front end's
    smart_resize, between min_pixels and max_pixels), over (height / factor) * (width / factor) placeholders
    (factor = patch_size * merge_size): no fixed num_image_tokens. Hub files keep the text model's fields
    at the top level (rope_scaling {"type": "mrope", "mrope_section": ...}), transformers 5's in text_config
    (rope_parameters); both are read. The text half's rotary is plain rope (what M-RoPE is for text alone)."""
    arch = next(a for a in cfg["architectures"] if a in QWEN2_VL_ARCHITECTURES)
    qwen25 = arch == "Qwen2_5_VLForConditionalGeneration"
    text = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config", "architectures", "model_type")}
    text.update(cfg.get("text_config") or {})
    rope = dict(text.pop("rope_scaling", None) or text.get("rope_parameters") or {})
    section = list(rope.get("mrope_section") or (16, 24, 24))
    theta = rope.get("rope_theta", text.get("rope_theta", 1e6))
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    text.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))))
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if 2 * sum(section) != head_dim:
        raise ValueError(f"mrope_section {section} does not cover the {head_dim} rotary dims (twice its sum)")
    v = dict(cfg.get("vision_config") or {})
    embed = v.get("hidden_size", 1280) if qwen25 else v.get("embed_dim", 1280)
    vision = dict(
        architecture=arch,
        text_architecture="Qwen2ForCausalLM",
        family="qwen2_5_vl" if qwen25 else "qwen2_vl",
        image_token_id=int(cfg.get("image_token_id", 151655)),
        vision_start_token_id=int(cfg.get("vision_start_token_id", 151652)),
        mrope_section=section,
        patch_size=int(v.get("patch_size", v.get("spatial_patch_size", 14))),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        merge_size=int(v.get("spatial_merge_size", 2)),
        min_pixels=QWEN2_VL_MIN_PIXELS, max_pixels=QWEN2_VL_MAX_PIXELS,  # from_folder: the folder's own
        num_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        embed_dim=int(embed),
        depth=int(v.get("depth", 32)),
        num_heads=int(v.get("num_heads", 16)),
        hidden_act=v.get("hidden_act", "silu" if qwen25 else "quick_gelu"),
        intermediate_size=int(v.get("intermediate_size", 3420) if qwen25 else embed * v.get("mlp_ratio", 4)),
        out_hidden_size=int(v.get("out_hidden_size", text["hidden_size"]) if qwen25 else
                            v.get("hidden_size", text["hidden_size"])),
        window_size=int(v.get("window_size", 112)) if qwen25 else 0,
        fullatt_block_indexes=list(v.get("fullatt_block_indexes", (7, 15, 23, 31))) if qwen25 else [],
        rescale_factor=1 / 255, image_mean=CLIP_MEAN, image_std=CLIP_STD,
    )
    if vision["out_hidden_size"] != text["hidden_size"]:
        raise ValueError(f"the vision tower's output width {vision['out_hidden_size']} is not the text model's "
                         f"hidden_size {text['hidden_size']}")
    return text, vision


def image_grid(height: int, width: int, vision: dict) -> tuple[int, int]:
    """(rows, columns) of a dynamic-resolution image's merged patches: its placeholders are rows * columns."""
    factor = vision["patch_size"] * vision["merge_size"]
    return height // factor, width // factor


def llava_parts(cfg: dict) -> tuple[dict, dict]:
    """(the text model's config dict with its `architectures`, the vision settings)."""
    text = _text_half(cfg)
    arch = text["architectures"][0]
    clip = {**CLIP_DEFAULTS, **(cfg.get("vision_config") or {})}
    if clip.get("model_type", "clip_vision_model") not in ("clip_vision_model", "clip"):
        raise ValueError(f"LLaVA with a {clip['model_type']!r} vision tower is not supported (CLIP only)")
    layers = cfg.get("vision_feature_layer", -2)
    layers = [layers] if isinstance(layers, int) else list(layers)
    num_layers = clip["num_hidden_layers"]
    # hidden_states[i]: 0 is the embeddings (after pre_layrnorm), i the output of encoder layer i
    layers = [i + num_layers + 1 if i < 0 else i for i in layers]
    if not all(0 <= i <= num_layers for i in layers):
        raise ValueError(f"vision_feature_layer {cfg.get('vision_feature_layer')!r} is outside the "
                         f"{num_layers} layers of the vision tower")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}; supported: default, full")
    patches = (clip["image_size"] // clip["patch_size"]) ** 2
    image_token = cfg.get("image_token_index", cfg.get("image_token_id", 32000))
    vision = dict(
        architecture="LlavaForConditionalGeneration",
        text_architecture=arch,
        image_token_id=image_token,
        feature_layers=layers,  # hidden-state indices, non-negative, concatenated in this order
        select_strategy=strategy,
        num_image_tokens=patches + (1 if strategy == "full" else 0),
        projector_hidden_act=cfg.get("projector_hidden_act", "gelu"),
        projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
        **tower_fields(clip),
        rescale_factor=1 / 255, image_mean=CLIP_MEAN, image_std=CLIP_STD,  # from_folder: the folder's own
    )
    return text, vision


def image_normalization(preprocessor: dict | None, vision: dict) -> dict:
    """What the worker applies to an image's uint8 RGB values, from the folder's preprocessor_config.json
    (the image processor's fields; the model's defaults in `vision` when absent): value * rescale_factor,
    then per channel (x - image_mean) / image_std."""
    p = preprocessor or {}
    normalize = p.get("do_normalize", True)
    if "min_pixels" in vision:  # Qwen2-VL's processor: its pixel range (hub files' keys, or transformers 5's size)
        size = p.get("size") or {}
        bounds = dict(min_pixels=int(p.get("min_pixels", size.get("shortest_edge", vision["min_pixels"]))),
                      max_pixels=int(p.get("max_pixels", size.get("longest_edge", vision["max_pixels"]))))
    else:
        bounds = {}
    return dict(**bounds,
        rescale_factor=float(p.get("rescale_factor", vision["rescale_factor"])) if p.get("do_rescale", True) else 1.0,
        image_mean=tuple(p.get("image_mean") or vision["image_mean"]) if normalize else (0.0,) * 3,
        image_std=tuple(p.get("image_std") or vision["image_std"]) if normalize else (1.0,) * 3)


def largest_step_tokens(vision: dict | None, max_num_batched_tokens: int) -> int:
    """The most tokens one step can compute under max_num_batched_tokens: that many, or, for a model whose
    image is computed whole (`bidirectional`: Gemma 3), one image's placeholders less one more: a chunk
    that starts at or inside an image runs to its end past the budget (scheduler/core/image_chunks.py),
    after the step's other tokens took all but one of it. The worker's memory profile runs a step this
    large, or such a step could take more memory than the KV budget left beside the profiled peak."""
    if vision and vision.get("bidirectional"):
        return max_num_batched_tokens + int(vision["num_image_tokens"]) - 1
    return max_num_batched_tokens


def image_problem(images, prompt_token_ids: list[int], vision: dict | None) -> str | None:
    """Why these ImageInputs cannot go with this prompt to this model (ModelConfig.vision), or None: the
    worker encodes an image into exactly num_image_tokens rows, from image_size x image_size pixels, over
    that many copies of image_token_id. (Placement and order: multimodal.check_placements.)"""
    if not images:
        return None
    if vision is None:
        return "this model takes no images"
    if "min_pixels" in vision:
        return _dynamic_problem(images, prompt_token_ids, vision)
    if vision.get("family") == "pixtral":  # a span of rows with breaks (pixtral_config.py)
        return span_problem(images, prompt_token_ids, vision)
    want, size, token = vision["num_image_tokens"], vision["image_size"], vision["image_token_id"]
    for image in images:
        if image.length != want:
            return f"an image over {image.length} placeholder tokens: this model encodes each image into {want}"
        if (image.height, image.width) != (size, size):
            return f"an image of {image.height}x{image.width}: this model's vision tower takes {size}x{size}"
        if any(t != token for t in prompt_token_ids[image.offset:image.end]):
            return f"an image's placeholders at {image.offset}..{image.end} are not all the image token {token}"
    return None


def _dynamic_problem(images, prompt_token_ids: list[int], vision: dict) -> str | None:
    """image_problem for a dynamic-resolution tower (Qwen2-VL): sides multiples of its factor, pixels in
    its range, placeholders one per merged patch."""
    factor, token = vision["patch_size"] * vision["merge_size"], vision["image_token_id"]
    for image in images:
        h, w = image.height, image.width
        why = dynamic_size_problem(h, w, factor, vision["min_pixels"], vision["max_pixels"])
        if why:
            return why
        rows, cols = image_grid(h, w, vision)
        if image.length != rows * cols:
            return (f"an image over {image.length} placeholder tokens: this model encodes a {h}x{w} image "
                    f"into {rows * cols}")
        if any(t != token for t in prompt_token_ids[image.offset:image.end]):
            return f"an image's placeholders at {image.offset}..{image.end} are not all the image token {token}"
    return None


MAX_ASPECT = 200  # Qwen2-VL's smart_resize refuses a longer side over 200 times the shorter


def dynamic_size_problem(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> str | None:
    """Why a dynamic-resolution tower (Qwen2-VL) cannot take an image of height x width, or None: sides
    multiples of factor, pixels within [min_pixels, max_pixels], except what transformers' smart_resize
    itself makes of an extreme aspect ratio (the short side clamped to factor, the long side at most
    MAX_ASPECT times it, past max_pixels when the range is small)."""
    if height <= 0 or width <= 0 or height % factor or width % factor:
        return f"an image of {height}x{width}: this model's vision tower takes sides that are multiples of {factor}"
    clamped = min(height, width) == factor and max(height, width) <= MAX_ASPECT * factor
    if height * width < min_pixels or (height * width > max_pixels and not clamped):
        return f"an image of {height}x{width} = {height * width} pixels: this model takes {min_pixels} to {max_pixels}"
    return None


# Gemma3TextConfig's defaults (a hub text_config names only what differs: gemma-3-4b-it's six keys) and
# SiglipVisionConfig's (Gemma 3's tower is SigLIP-So400m at 896 over patches of 14: its config names those)
GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                            max_position_embeddings=131_072, query_pre_attn_scalar=256, sliding_window=4096,
                            bos_token_id=2, eos_token_id=1, pad_token_id=0, hidden_activation="gelu_pytorch_tanh")
SIGLIP_VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=224, patch_size=16, num_channels=3, hidden_act="gelu_pytorch_tanh",
                              layer_norm_eps=1e-6)


def gemma3_parts(cfg: dict) -> tuple[dict, dict]:
    """Gemma 3 (Gemma3ForConditionalGeneration): a SigLIP tower over image_size squares (plain position ids
    0..N-1), the projector (average-pooled to mm_tokens_per_image rows, soft-embedding RMSNorm, projection),
    our Gemma3ForCausalLM text model, whose embedding scale applies to text tokens only. An image's
    mm_tokens_per_image placeholders attend to each other both ways (`bidirectional`: transformers'
    token_type_ids mask), so a step computes all of an image's placeholders or none (the scheduler's
    image_chunks.py). The LM head is tied by Gemma3Config's own flag (True when absent)."""
    text = {**GEMMA3_TEXT_DEFAULTS, **(cfg.get("text_config") or {})}
    if text.get("use_bidirectional_attention"):
        raise ValueError("a Gemma 3 text model with use_bidirectional_attention is not supported")
    text.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    if "quantization_config" in cfg:
        text["quantization_config"] = cfg["quantization_config"]
    siglip = {**SIGLIP_VISION_DEFAULTS, **(cfg.get("vision_config") or {})}
    tokens = int(cfg.get("mm_tokens_per_image", 256))
    side, per_side = siglip["image_size"] // siglip["patch_size"], int(round(tokens ** 0.5))
    if per_side * per_side != tokens or side % per_side:
        raise ValueError(f"mm_tokens_per_image {tokens} does not pool the tower's {side}x{side} patches evenly")
    vision = dict(
        architecture="Gemma3ForConditionalGeneration",
        text_architecture="Gemma3ForCausalLM",
        image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 262_144))),
        boi_token_id=int(cfg.get("boi_token_index", cfg.get("boi_token_id", 255_999))),
        eoi_token_id=int(cfg.get("eoi_token_index", cfg.get("eoi_token_id", 256_000))),
        num_image_tokens=tokens,
        bidirectional=True,  # an image's placeholders see each other (worker/image_rows.key_limits)
        plain_positions=True,  # the tower's position ids 0..N-1 (not Idefics3's buckets)
        **tower_fields(siglip),
        rescale_factor=1 / 255, image_mean=HALF, image_std=HALF,  # Gemma3ImageProcessor's defaults
    )
    return text, vision

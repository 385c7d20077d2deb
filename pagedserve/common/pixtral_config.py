"""Pixtral's vision half: Mistral3ForConditionalGeneration (Mistral-Small-3.1 / 3.2: the Pixtral ViT,
Mistral3's projector with its RMSNorm and spatial_merge_size x spatial_merge_size patch merger, a Mistral
text model) and LlavaForConditionalGeneration whose vision_config.model_type is "pixtral" (pixtral-12b: the
Pixtral ViT, LLaVA's 2-layer projector, no merge), read from config.json (vision_config.vision_parts calls
here) into the text model's dict and the vision settings (family "pixtral").

An image arrives at its own size, both sides multiples of factor = patch_size * merge_size and none longer
than the tower's image_size rounded up to factor (the front end's resize: pixtral_images.py). Its rows are
rows = height / factor and cols = width / factor, and its placeholder span is PixtralProcessor's: per row
`cols` copies of image_token_id then image_break_token_id, the last row's break replaced by
image_end_token_id: rows * (cols + 1) tokens. As vLLM (its embed_is_patch), the ImageInput covers the whole
span, breaks and end included; the worker gives one row per span position (the tower's at image tokens, the
text embedding of the break or end token elsewhere), so chunked placement and prefix hits inside an image
work as for any image. image_problem (vision_config) checks the span exactly (span_problem here).

Defaults for keys a config.json leaves out are transformers' (PixtralVisionConfig; Mistral3Config's
sub-config defaults; LlavaConfig's). The break and end ids are the Mistral tokenizer's (12, 13) unless
config.json names them; the front end checks the folder's tokenizer against them. No torch.
"""

from __future__ import annotations

# PixtralVisionConfig's defaults (rope_parameters {"rope_type": "axial", "rope_theta": 10000.0})
PIXTRAL_DEFAULTS = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                        num_channels=3, image_size=1024, patch_size=16, hidden_act="gelu")
# Mistral3Config's vision_config and text_config defaults (a config.json without them)
MISTRAL3_VISION = dict(PIXTRAL_DEFAULTS, patch_size=14, image_size=1540)
MISTRAL3_TEXT = dict(model_type="mistral", head_dim=128, hidden_act="silu", hidden_size=5120,
                     intermediate_size=32768, max_position_embeddings=131072, num_attention_heads=32,
                     num_hidden_layers=40, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e9,
                     sliding_window=None, vocab_size=131072)
# transformers' MistralConfig defaults, for a text_config that names only what differs (pixtral-12b's)
MISTRAL_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                        rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096, hidden_act="silu")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # PixtralImageProcessor's normalization defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_BREAK_ID, IMAGE_END_ID = 12, 13  # [IMG_BREAK], [IMG_END] in Mistral's tokenizers


def is_pixtral(cfg: dict) -> bool:
    archs = set(cfg.get("architectures") or ())
    if "Mistral3ForConditionalGeneration" in archs:
        return True
    return "LlavaForConditionalGeneration" in archs and (cfg.get("vision_config") or {}).get("model_type") == "pixtral"


def _theta(v: dict) -> float:
    rope = v.get("rope_parameters") or v.get("rope_scaling") or {}
    return float(rope.get("rope_theta", v.get("rope_theta", 10000.0)))


def pixtral_parts(cfg: dict, text_half) -> tuple[dict, dict]:
    """(the text model's dict, the vision settings) of a Mistral3 or Pixtral-LLaVA config.json; text_half:
    vision_config._text_half (the text_config with its `architectures`)."""
    mistral3 = "Mistral3ForConditionalGeneration" in (cfg.get("architectures") or ())
    if mistral3 and not cfg.get("text_config"):
        cfg = {**cfg, "text_config": MISTRAL3_TEXT}
    text = text_half(cfg)
    if text.get("model_type") == "mistral":
        for key, value in MISTRAL_DEFAULTS.items():
            if key != "rope_theta" or "rope_parameters" not in text:
                text.setdefault(key, value)
    v = {**(MISTRAL3_VISION if mistral3 else PIXTRAL_DEFAULTS), **(cfg.get("vision_config") or {})}
    num_layers = int(v["num_hidden_layers"])
    layers = cfg.get("vision_feature_layer", -1)
    layers = [layers] if isinstance(layers, int) else list(layers)
    layers = [i + num_layers + 1 if i < 0 else i for i in layers]
    if not all(0 <= i <= num_layers for i in layers) or (mistral3 and len(layers) != 1):
        raise ValueError(f"vision_feature_layer {cfg.get('vision_feature_layer')!r} is not one layer of the "
                         f"{num_layers} of the vision tower" if mistral3 else "outside the vision tower's layers")
    if not mistral3 and cfg.get("vision_feature_select_strategy", "default") != "full":
        raise ValueError("LLaVA with a Pixtral tower takes vision_feature_select_strategy 'full' only (it has no "
                         "class row to drop)")
    merge = int(cfg.get("spatial_merge_size", 2)) if mistral3 else 1
    patch, size = int(v["patch_size"]), int(v["image_size"])
    factor = patch * merge
    vision = dict(
        architecture="Mistral3ForConditionalGeneration" if mistral3 else "LlavaForConditionalGeneration",
        text_architecture=text["architectures"][0],
        family="pixtral",
        projector="mistral3" if mistral3 else "llava",
        image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 10))),
        image_break_token_id=int(cfg.get("image_break_token_id", IMAGE_BREAK_ID)),
        image_end_token_id=int(cfg.get("image_end_token_id", IMAGE_END_ID)),
        feature_layers=layers,
        patch_size=patch,
        merge_size=merge,
        image_size=size,
        max_side=-(-size // factor) * factor,  # the resize's sides at most: image_size rounded up to factor
        num_channels=int(v.get("num_channels", 3)),
        hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=int(v["num_attention_heads"]),
        hidden_act=v["hidden_act"],
        rope_theta=_theta(v),
        projector_hidden_act=cfg.get("projector_hidden_act", "gelu"),
        projector_bias=bool(cfg.get("multimodal_projector_bias", not mistral3)),
        projector_norm_eps=float(text.get("rms_norm_eps", 1e-5 if mistral3 else 1e-6)),
        rescale_factor=1 / 255, image_mean=CLIP_MEAN, image_std=CLIP_STD,  # from_folder: the folder's own
    )
    return text, vision


def pixtral_grid(height: int, width: int, vision: dict) -> tuple[int, int]:
    """(rows, cols) of an image's (merged) patches: its span is rows * (cols + 1) tokens."""
    factor = vision["patch_size"] * vision["merge_size"]
    return height // factor, width // factor


def span_tokens(rows: int, cols: int, image: int, brk: int, end: int) -> list[int]:
    """PixtralProcessor's tokens for an image of rows x cols: each row `cols` image tokens then a break, the
    last break an end."""
    span = ([image] * cols + [brk]) * rows
    span[-1] = end
    return span


def span_problem(images, prompt_token_ids: list[int], vision: dict) -> str | None:
    """image_problem for the Pixtral family: sides multiples of factor within max_side, the ImageInput over
    exactly its span, and the prompt's tokens there exactly PixtralProcessor's."""
    factor, top = vision["patch_size"] * vision["merge_size"], vision["max_side"]
    ids = (vision["image_token_id"], vision["image_break_token_id"], vision["image_end_token_id"])
    for image in images:
        h, w = image.height, image.width
        if h <= 0 or w <= 0 or h % factor or w % factor or h > top or w > top:
            return (f"an image of {h}x{w}: this model's vision tower takes sides that are multiples of {factor}, "
                    f"at most {top}")
        rows, cols = pixtral_grid(h, w, vision)
        if image.length != rows * (cols + 1):
            return (f"an image over {image.length} placeholder tokens: this model's {h}x{w} image spans "
                    f"{rows * (cols + 1)} ({rows} rows of {cols} image tokens and a break or end token)")
        if list(prompt_token_ids[image.offset:image.end]) != span_tokens(rows, cols, *ids):
            return (f"an image's placeholders at {image.offset}..{image.end} are not its rows of image tokens "
                    f"{ids[0]} each ended by the break {ids[1]}, the last by the end {ids[2]}")
    return None

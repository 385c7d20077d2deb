"""The Pixtral family's config.json as the hub's files write it (transformers-4 layouts, keys left to
transformers' defaults) and as transformers 5 saves it: vision_config.vision_parts gives the text half a
ModelConfig reads and the vision settings (common/pixtral_config.py); what it refuses."""

from __future__ import annotations

import pytest

from pagedserve.common.model_config import ModelConfig
from pagedserve.common.vision_config import vision_parts

# mistral-community/pixtral-12b's config.json (transformers 4.45: the vision tower's shape left to its defaults)
PIXTRAL_12B = {
    "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 10, "model_type": "llava",
    "projector_hidden_act": "gelu",
    "text_config": {"hidden_size": 5120, "head_dim": 128, "intermediate_size": 14336, "is_composition": True,
                    "max_position_embeddings": 1024000, "model_type": "mistral", "num_hidden_layers": 40,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0,
                    "sliding_window": None, "vocab_size": 131072},
    "vision_config": {"head_dim": 64, "hidden_act": "silu", "image_size": 1024, "is_composition": True,
                      "model_type": "pixtral", "patch_size": 16, "rope_theta": 10000.0, "tie_word_embeddings": False},
    "vision_feature_layer": -1, "vision_feature_select_strategy": "full"}
# mistralai/Mistral-Small-3.1-24B-Instruct-2503's (transformers 4.50)
MISTRAL_SMALL = {
    "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "text_config": {"attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
                    "intermediate_size": 32768, "max_position_embeddings": 131072, "model_type": "mistral",
                    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
                    "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 131072},
    "vision_config": {"attention_dropout": 0.0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024,
                      "image_size": 1540, "intermediate_size": 4096, "model_type": "pixtral",
                      "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 24, "patch_size": 14,
                      "rope_theta": 10000.0},
    "vision_feature_layer": -1}


def test_pixtral_12b_reads_with_transformers_defaults():
    text, v = vision_parts(PIXTRAL_12B)
    assert (v["architecture"], v["family"], v["projector"]) == ("LlavaForConditionalGeneration", "pixtral", "llava")
    assert (v["hidden_size"], v["intermediate_size"], v["num_hidden_layers"], v["num_attention_heads"]) == \
        (1024, 4096, 24, 16)  # PixtralVisionConfig's
    assert (v["patch_size"], v["merge_size"], v["max_side"], v["feature_layers"]) == (16, 1, 1024, [24])
    assert (v["image_token_id"], v["image_break_token_id"], v["image_end_token_id"]) == (10, 12, 13)
    assert v["projector_bias"] and v["rope_theta"] == 10000.0
    cfg = ModelConfig.from_hf_dict(PIXTRAL_12B)
    assert cfg.architecture == "LlavaForConditionalGeneration" and cfg.vision is not None
    assert (cfg.num_attention_heads, cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings) == (32, 128, 131072, False)


def test_mistral_small_reads():
    text, v = vision_parts(MISTRAL_SMALL)
    assert (v["architecture"], v["projector"], v["text_architecture"]) == \
        ("Mistral3ForConditionalGeneration", "mistral3", "MistralForCausalLM")
    assert (v["patch_size"], v["merge_size"], v["max_side"], v["image_size"]) == (14, 2, 1540, 1540)
    assert not v["projector_bias"] and v["projector_norm_eps"] == 1e-5 and v["feature_layers"] == [24]
    cfg = ModelConfig.from_hf_dict(MISTRAL_SMALL)
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (40, 8, 128)
    assert not cfg.tie_word_embeddings  # (the checkpoint has its own lm_head)
    bare = {"architectures": ["Mistral3ForConditionalGeneration"]}  # Mistral3Config's sub-config defaults
    text, v = vision_parts(bare)
    assert (text["hidden_size"], text["num_hidden_layers"], v["image_size"], v["patch_size"]) == (5120, 40, 1540, 14)
    assert v["image_token_id"] == 10 and v["feature_layers"] == [24]


def test_transformers5_layout_reads_the_same():
    """transformers 5 writes rope_parameters where 4 wrote rope_theta."""
    new = {**MISTRAL_SMALL, "vision_config": {**MISTRAL_SMALL["vision_config"], "rope_theta": None,
                                              "rope_parameters": {"rope_type": "axial", "rope_theta": 5000.0}}}
    new["vision_config"].pop("rope_theta")
    assert vision_parts(new)[1]["rope_theta"] == 5000.0


def test_refusals():
    with pytest.raises(ValueError, match="'full' only"):
        vision_parts({**PIXTRAL_12B, "vision_feature_select_strategy": "default"})
    with pytest.raises(ValueError, match="not one layer"):
        vision_parts({**MISTRAL_SMALL, "vision_feature_layer": [-1, -2]})
    with pytest.raises(ValueError, match="outside"):
        vision_parts({**PIXTRAL_12B, "vision_feature_layer": 30})
    clip = {**PIXTRAL_12B, "vision_config": {"model_type": "siglip_vision_model"}}
    with pytest.raises(ValueError, match="CLIP only"):  # LLaVA's other towers stay refused
        vision_parts(clip)

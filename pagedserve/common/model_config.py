"""The model's shape, read from a HuggingFace config.json (transformers 4 or 5 layout)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.common.checkpoint_quantization import check_quantization
from pagedserve.common.processor_kwargs import preprocessor
from pagedserve.common.vision_config import VISION_ARCHITECTURES, image_normalization, vision_parts

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM",
                           "Qwen2MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                           "Gemma3ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM",
                           "SmolLM3ForCausalLM", "GraniteForCausalLM", "Gemma2ForCausalLM",
                           "Olmo2ForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "Starcoder2ForCausalLM",
                           *VISION_ARCHITECTURES)
# Architectures whose transformers config ties the LM head to the embeddings when config.json is silent.
TIED_BY_DEFAULT = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "SmolLM3ForCausalLM", "CohereForCausalLM",
                   "Cohere2ForCausalLM", "Starcoder2ForCausalLM")
# Models whose layers interleave sliding-window and full attention (layer_types), in KV groups.
INTERLEAVED_WINDOW_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Cohere2ForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one rank's KV pool stores per token per layer: `num_planes` (2: K and V; 1: MLA's
    single latent) x `num_heads` x `head_dim` values."""
    num_planes: int
    num_heads: int
    head_dim: int


def layer_types(hf: dict) -> list[str]:
    """Gemma 2 and 3, Cohere2: 'sliding_attention' or 'full_attention' per layer, from config.json
    (`layer_types`, or every `sliding_window_pattern`-th layer global: Gemma 3's default 6, Gemma 2's
    every second layer)."""
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    default = 2 if hf.get("model_type") == "gemma2" else 6
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or default
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


@dataclass(frozen=True, slots=True)
class KVGroups:
    """How the layers share the KV pool (after vLLM v1's hybrid KV-cache manager).

    Layers are grouped by attention kind into groups of equal size k (the gcd of the kinds'
    layer counts), full-attention groups first. A block id means "k layers x block_size tokens"
    in every group: the KV tensor has k layer slots, and layer `layers[g][s]` lives in slot s of
    group g's blocks. Each request has one block table per group; a sliding group's table drops
    (frees) the blocks that fall out of its window. A model without sliding layers is one group
    of all its layers, window 0: one table, exactly the layout of a plain paged cache.
    """
    layers: tuple[tuple[int, ...], ...]  # per group, its layers (index = slot)
    windows: tuple[int, ...]  # per group: 0 = full attention, else the sliding window in tokens

    @property
    def num_slots(self) -> int:
        return len(self.layers[0])

    @property
    def hybrid(self) -> bool:
        return any(self.windows)

    def slot_of(self) -> dict[int, tuple[int, int]]:
        """layer -> (group, slot)."""
        return {layer: (g, s) for g, group in enumerate(self.layers) for s, layer in enumerate(group)}


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None = None
    hf: dict = field(default_factory=dict, repr=False, compare=False)  # the whole config.json, for the MoE/MLA fields
    # A vision-language model's vision settings (common/vision_config.py; with from_folder the image
    # normalization too); architecture is then the VLM's, every other field (and hf) its text model's.
    vision: dict | None = None

    @property
    def is_mla(self) -> bool:
        return self.architecture in MLA_ARCHITECTURES and self.hf.get("kv_lora_rank") is not None

    def kv_layout(self, tensor_parallel_size: int = 1) -> KVLayout:
        if self.is_mla:  # the compressed latent and the shared rope key, the same on every rank
            return KVLayout(1, 1, self.hf["kv_lora_rank"] + self.hf["qk_rope_head_dim"])
        # KV heads split across ranks; with fewer KV heads than ranks each rank keeps one.
        return KVLayout(2, max(1, self.num_key_value_heads // tensor_parallel_size), self.head_dim)

    def kv_groups(self) -> KVGroups:
        """Gemma 2 or 3 with a window: its global and local layers in groups (KVGroups); every other
        model (and a Gemma without a window, or with only one kind of layer): one group."""
        n = self.num_hidden_layers
        arch = (self.vision or {}).get("text_architecture", self.architecture)  # a Gemma 3 with images: its text's
        window = self.hf.get("sliding_window") if arch in INTERLEAVED_WINDOW_ARCHITECTURES else None
        kinds = layer_types({**self.hf, "num_hidden_layers": n}) if window else []
        local = [i for i, t in enumerate(kinds) if t == "sliding_attention"]
        full = [i for i, t in enumerate(kinds) if t != "sliding_attention"]
        if not local or not full:
            return KVGroups((tuple(range(n)),), (0,))
        k = math.gcd(len(local), len(full))
        groups = [tuple(full[i:i + k]) for i in range(0, len(full), k)]
        groups += [tuple(local[i:i + k]) for i in range(0, len(local), k)]
        return KVGroups(tuple(groups), tuple(0 if g[0] in full else int(window) for g in groups))

    @classmethod
    def from_hf_dict(cls, cfg: dict, where: str = "the model") -> "ModelConfig":
        check_quantization(cfg, where)  # before anything else: no weight of such a checkpoint would load
        archs = cfg.get("architectures") or []
        parts = vision_parts(cfg)
        if parts is not None:
            text, vision = parts
            config = cls.from_hf_dict(text, where)
            config.architecture, config.vision = vision["architecture"], vision
            return config
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        # transformers 5 keeps rope settings under rope_parameters; older files at top level.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if arch == "Phi3ForCausalLM" and scaling["rope_type"] in ("su", "yarn"):
                scaling["rope_type"] = "longrope"  # Phi-3's older names for it (as transformers maps them)
            if scaling["rope_type"] == "default":
                scaling = None
            elif scaling["rope_type"] == "longrope" and arch == "Phi3ForCausalLM":
                pass  # models/phi3.py
            elif scaling["rope_type"] == "yarn" and arch in MLA_ARCHITECTURES:
                pass  # DeepSeek's own rope (models/deepseek.py) implements yarn with its mscale
            elif scaling["rope_type"] not in ("llama3", "linear"):
                raise ValueError(f"unsupported rope_scaling type {scaling['rope_type']!r} for {arch}; "
                                 "supported: llama3, linear (yarn for DeepSeek, longrope for Phi-3)")
        if arch == "SmolLM3ForCausalLM" and cfg.get("use_sliding_window"):
            raise ValueError("SmolLM3 with use_sliding_window is not supported (its sliding layers are not "
                             "implemented)")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in TIED_BY_DEFAULT)),
            attention_bias=(arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
                            or bool(cfg.get("attention_bias", False))
                            or (arch == "Starcoder2ForCausalLM" and bool(cfg.get("use_bias", True)))),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            # Phi-3 and Starcoder2 have no use_sliding_window switch: a sliding_window there is always applied.
            sliding_window=(cfg.get("sliding_window") if cfg.get("use_sliding_window")
                            or arch in ("Phi3ForCausalLM", "Starcoder2ForCausalLM") else None),
            hf=dict(cfg),
        )

    @classmethod
    def from_folder(cls, folder: str | Path, mm_processor_kwargs: str | dict | None = None) -> "ModelConfig":
        """The model in folder; a vision model's image settings from its preprocessor_config.json with
        --mm-processor-kwargs laid over it (common/processor_kwargs.py, as the front end reads it)."""
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"corrupt config.json in {folder}: {exc}") from exc
        config = cls.from_hf_dict(cfg, f"the model in {folder}")
        pre = preprocessor(folder, cfg, mm_processor_kwargs)  # a text model with overrides: refused
        if config.vision is not None:
            config.vision.update(image_normalization(pre, config.vision))
        return config

"""The model's shape, read from a HuggingFace config.json (transformers 4 or 5 layout)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.common.checkpoint_quantization import check_quantization

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM",
                           "Qwen2MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                           "Gemma3ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one rank's KV pool stores per token per layer: `num_planes` (2: K and V; 1: MLA's
    single latent) x `num_heads` x `head_dim` values."""
    num_planes: int
    num_heads: int
    head_dim: int


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

    @property
    def is_mla(self) -> bool:
        return self.architecture in MLA_ARCHITECTURES and self.hf.get("kv_lora_rank") is not None

    def kv_layout(self, tensor_parallel_size: int = 1) -> KVLayout:
        if self.is_mla:  # the compressed latent and the shared rope key, the same on every rank
            return KVLayout(1, 1, self.hf["kv_lora_rank"] + self.hf["qk_rope_head_dim"])
        # KV heads split across ranks; with fewer KV heads than ranks each rank keeps one.
        return KVLayout(2, max(1, self.num_key_value_heads // tensor_parallel_size), self.head_dim)

    @classmethod
    def from_hf_dict(cls, cfg: dict, where: str = "the model") -> "ModelConfig":
        check_quantization(cfg, where)  # before anything else: no weight of such a checkpoint would load
        archs = cfg.get("architectures") or []
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
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=(arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
                            or bool(cfg.get("attention_bias", False))),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            # Phi-3 has no use_sliding_window switch: a sliding_window there is always applied.
            sliding_window=(cfg.get("sliding_window") if cfg.get("use_sliding_window") or arch == "Phi3ForCausalLM"
                            else None),
            hf=dict(cfg),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"corrupt config.json in {folder}: {exc}") from exc
        return cls.from_hf_dict(cfg, f"the model in {folder}")

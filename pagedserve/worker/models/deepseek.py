"""DeepSeek-V2 / V3: multi-head latent attention (MLA) over a paged latent cache, and DeepSeek-MoE
(shared experts plus routed experts; V3 sigmoid routing with a load-balancing bias, V2 softmax,
both optionally group-limited).

MLA: a token's keys and values come from one compressed latent c_kv (kv_lora_rank values, after
kv_a_layernorm) expanded per head by kv_b_proj, plus a rotary key k_pe shared by all heads. The
cache stores only [c_kv, k_pe] per token and layer, and attention runs in the absorbed form:
the key half of kv_b_proj (W_UK) is folded into the query, the value half (W_UV) applied to the
attention's latent output (see pagedserve.worker.mla_attention).

Tensor parallelism: heads split across ranks (q_b_proj / q_proj and kv_b_proj by output rows,
o_proj by input columns); the latent projections and their norms are replicated, so every rank
caches the same latents. An MoE block ends with one all_reduce over the routed experts' and the
shared experts' partial sums.

Numerics follow transformers' DeepseekV3 / DeepseekV2 (float32 router, float32 rotary tables with
yarn's attention factor, interleaved rope pairs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend, AttentionMetadata
from pagedserve.worker.mla_attention import MLAAttentionBackend
from pagedserve.worker.models.llama import LlamaForCausalLM, LlamaMLP, RMSNorm
from pagedserve.worker.moe import FusedMoE, expert_part, grouped_topk, softmax_topk
from pagedserve.worker.ops import gathered_rope
from pagedserve.worker.parallel import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    Shard,
    copy_checked,
    mark_loader,
)
from pagedserve.worker.process_group import all_reduce, tp_group
from pagedserve.worker.platform import current_platform

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


# ---- rotary embedding -----------------------------------------------------------------------
def rope_parameters(cfg: ModelConfig) -> dict:
    """The rope settings from config.json: transformers 5 `rope_parameters`, or the older
    `rope_scaling` (DeepSeek's own files: {"type": "yarn", ...}), normalised to `rope_type`."""
    hf = cfg.hf
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", cfg.rope_theta)
    return params


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(cfg: ModelConfig, params: dict) -> float:
    original = params.get("original_max_position_embeddings") or cfg.max_position_embeddings
    return params.get("factor") or cfg.max_position_embeddings / original


def deepseek_rope(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies float32 [R / 2], attention factor multiplying cos and sin), as
    transformers' default and yarn rope initialisers compute them for head_dim = qk_rope_head_dim."""
    params = rope_parameters(cfg)
    base = float(params["rope_theta"])
    dim = int(cfg.hf["qk_rope_head_dim"] * params.get("partial_rotary_factor", 1.0))
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope_type != "yarn":
        raise ValueError(f"unsupported rope type {rope_type!r} for {cfg.architecture}; supported: default, yarn")
    original = params.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = yarn_factor(cfg, params)
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # the share of the original (unscaled) frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared."""
    hf = cfg.hf
    scale = (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5
    params = rope_parameters(cfg)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        scale *= yarn_get_mscale(yarn_factor(cfg, params), params["mscale_all_dim"]) ** 2
    return scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotary on the last dim; cos/sin hold one angle per pair [..., R / 2]. Interleaved pairs are
    (x0, x1), (x2, x3), ... and come out de-interleaved (transformers' rope_interleave; DeepSeek-V2's
    complex form gives the same dot products, as q and k share the layout); otherwise the pairs are
    (x_i, x_{i + R/2}) as in rotate_half."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ---- attention ------------------------------------------------------------------------------
def head_shard(num_heads: int, head_dim: int) -> Shard:
    tp = tp_group()
    if num_heads % tp.world_size:
        raise ValueError(f"{num_heads} attention heads do not split across --tensor-parallel-size {tp.world_size}")
    local = num_heads // tp.world_size
    return Shard(tp.rank * local * head_dim, local * head_dim)


class MLAttention(nn.Module):
    """This rank's heads of one layer's multi-head latent attention."""

    def __init__(self, cfg: ModelConfig, backend: MLAAttentionBackend, interleave: bool, scale: float) -> None:
        super().__init__()
        hf = cfg.hf
        hidden, heads, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
        self.nope_dim, self.rope_dim, self.v_dim = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
        self.kv_lora_rank = hf["kv_lora_rank"]
        qk_dim = self.nope_dim + self.rope_dim
        self.num_heads = heads // tp_group().world_size
        self.q_lora_rank = hf.get("q_lora_rank")
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, [head_shard(heads, qk_dim)])
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, [head_shard(heads, qk_dim)])
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, [head_shard(heads, self.nope_dim + self.v_dim)])
        self.kv_b_proj.quant_parts = None  # read as float per-head views (absorbed_weights): never quantized
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias)
        self.backend, self.interleave, self.scale = backend, interleave, scale
        self.ops = current_platform().ops

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, L], W_UV [H, v, L]): views of kv_b_proj's rows, per head."""
        per_head = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return per_head[:, :self.nope_dim], per_head[:, self.nope_dim:]

    def forward(self, hidden, rope, kv_cache, meta: AttentionMetadata):
        num_tokens, ops = hidden.shape[0], self.ops
        if self.q_lora_rank is None:
            q = ops.linear(hidden, self.q_proj)
        else:
            q = ops.linear(self.q_a_layernorm(ops.linear(hidden, self.q_a_proj)), self.q_b_proj)
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split((self.nope_dim, self.rope_dim), dim=-1)
        latent, k_pe = ops.linear(hidden, self.kv_a_proj_with_mqa).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        latent = self.kv_a_layernorm(latent)
        cos, sin = rope
        q_pe = rotate(q_pe, cos, sin, self.interleave)
        k_pe = rotate(k_pe, cos.squeeze(1), sin.squeeze(1), self.interleave)
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        out = self.backend.forward(q_latent, q_pe, latent, k_pe, kv_cache[0], meta, self.scale)
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return ops.linear(out.reshape(num_tokens, -1), self.o_proj)


# ---- mixture of experts ---------------------------------------------------------------------
def load_float32(param: nn.Parameter, loaded, part: int = 0) -> None:
    """Read the checkpoint tensor in float32 whatever the serving dtype (transformers keeps the
    router and its bias in float32)."""
    loaded.dtype = torch.float32
    copy_checked(param.data, loaded.full())


def float32_param(*shape: int) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)
    mark_loader(param, load_float32, 1)
    return param


class DeepseekRouter(ReplicatedLinear):
    """The gate: float32 logits over all experts, on every rank; V3's e_score_correction_bias."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__(hidden_size, num_experts)
        self.weight = float32_param(num_experts, hidden_size)
        self.e_score_correction_bias = float32_param(num_experts) if correction_bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight)


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_backend) -> None:
        super().__init__()
        hf = cfg.hf
        self.v3 = cfg.architecture == "DeepseekV3ForCausalLM"
        num_experts, inter = hf["n_routed_experts"], hf["moe_intermediate_size"]
        self.top_k = hf["num_experts_per_tok"]
        self.num_groups, self.topk_groups = hf.get("n_group") or 1, hf.get("topk_group") or 1
        self.routed_scaling_factor = hf.get("routed_scaling_factor", 1.0)
        self.norm_topk_prob = bool(hf.get("norm_topk_prob", self.v3))
        self.topk_method = "noaux_tc" if self.v3 else hf.get("topk_method") or "greedy"
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unsupported topk_method {self.topk_method!r}")
        if self.topk_method != "greedy" and num_experts % self.num_groups:
            raise ValueError(f"{num_experts} experts do not split into n_group {self.num_groups}")
        self.gate = DeepseekRouter(cfg.hidden_size, num_experts, correction_bias=self.v3)
        self.experts = FusedMoE(num_experts, cfg.hidden_size, inter, moe_backend, reduce=False)
        shared = hf.get("n_shared_experts") or 0
        self.shared_experts = LlamaMLP(cfg.hidden_size, inter * shared, reduce=False) if shared else None

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(hidden)
        if self.topk_method == "greedy":
            weights, ids = softmax_topk(logits, self.top_k, self.norm_topk_prob)
            return weights * self.routed_scaling_factor, ids
        return grouped_topk(logits, self.top_k, self.num_groups, self.topk_groups,
                            "sigmoid" if self.v3 else "softmax", self.gate.e_score_correction_bias,
                            self.norm_topk_prob, self.routed_scaling_factor)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(hidden)
        out = self.experts(hidden, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return all_reduce(out)


# ---- the model ------------------------------------------------------------------------------
class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM. Layers below first_k_dense_replace (and those
    off moe_layer_freq) have a dense MLP, the others DeepSeek-MoE. The standard attention backend
    handed in is not used: MLA takes its own from the platform of the device the model is built on."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None, max_positions: int) -> None:
        hf = cfg.hf
        if hf.get("kv_lora_rank") is None:
            raise ValueError(f"{cfg.architecture} without kv_lora_rank (no latent attention) is not supported")
        if hf.get("mlp_bias"):
            raise ValueError(f"{cfg.architecture} with mlp_bias is not supported")
        # Plain attributes, set before nn.Module.__init__ (which builds the layers through make_*).
        platform = current_platform()
        self._mla_backend = platform.mla_backend()
        self._moe_backend = platform.moe_backend()
        self._interleave = cfg.architecture == "DeepseekV2ForCausalLM" or bool(hf.get("rope_interleave", True))
        self._scale = softmax_scale(cfg)
        super().__init__(cfg, backend, max_positions)

    def make_attention(self, layer_index: int, backend: AttentionBackend) -> nn.Module:
        return MLAttention(self.cfg, self._mla_backend, self._interleave, self._scale)

    def is_moe_layer(self, layer_index: int) -> bool:
        hf = self.cfg.hf
        return (hf.get("n_routed_experts") is not None and layer_index >= (hf.get("first_k_dense_replace") or 0)
                and layer_index % (hf.get("moe_layer_freq") or 1) == 0)

    def make_mlp(self, layer_index: int) -> nn.Module:
        if self.is_moe_layer(layer_index):
            return DeepseekMoE(self.cfg, self._moe_backend)
        return LlamaMLP(self.cfg.hidden_size, self.cfg.intermediate_size)

    def init_rope(self, max_positions: int) -> None:
        inv_freq, attention_factor = deepseek_rope(self.cfg)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # One angle per rotated pair [positions, R / 2], float32, scaled as transformers scales cos/sin.
        self.register_buffer("cos_table", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_table", freqs.sin() * attention_factor, persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return gathered_rope(self.cos_table, self.sin_table, positions, dtype)  # interleaved pairs: native

    def map_name(self, name: str) -> tuple[str, object] | None:
        if not name.startswith("model.layers.") or "rotary_emb" in name:
            return super().map_name(name)  # embeddings, final norm, LM head
        name = name[len("model."):]
        if int(name.split(".", 2)[1]) >= self.cfg.num_hidden_layers:
            return None  # V3's multi-token-prediction layer(s) after the last decoder layer
        if ".mlp.experts." in name:
            head, _, tail = name.partition(".mlp.experts.")
            param, part = expert_part(tail)
            return f"{head}.mlp.experts.{param}", part
        for proj, part in (("gate_proj", 0), ("up_proj", 1)):
            if f".{proj}." in name:  # the dense MLP's and the shared experts' gate/up: one matmul
                head, _, tail = name.partition(f".{proj}.")
                return f"{head}.gate_up_proj.{tail}", part
        return name, 0

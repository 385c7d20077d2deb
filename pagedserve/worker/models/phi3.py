"""Phi-3 (and Phi-3.5 / Phi-4-mini, which share Phi3ForCausalLM): the Llama decoder whose checkpoint
stores q/k/v as one `qkv_proj` tensor and gate/up as one `gate_up_proj`, with LongRoPE ("su")
scaling and an optional partial rotary embedding.

The fused checkpoint tensors are read part by part: each rank takes its rows of the query, key
and value (gate, up) blocks of the one tensor (PackedColumnParallelLinear), so tensor
parallelism splits heads exactly as for Llama.

LongRoPE: two sets of per-frequency factors, `short_factor` and `long_factor`, and an attention
factor sqrt(1 + ln(s) / ln(original_max_position_embeddings)), s = max_position_embeddings /
original, multiplying cos and sin. transformers picks the long set for a forward pass whose
highest position reaches original_max_position_embeddings, else the short set. Here the choice
is made per sequence and step by the same rule (a decode at position p: long from p =
original; a prefill chunk: long when its last position reaches it), so a batch mixes both and
unchunked prompts match transformers token for token. A prompt longer than
original_max_position_embeddings prefilled in chunks gets the short set on its chunks before the
boundary (transformers, in one pass, gives every token the long set). The rope table holds the
short rows then the long rows; a token's position indexes the long half by adding max_positions.

Not handled (logged at load when the long set can be used): transformers recomputes a sequence's
whole cache with the long set when it grows past the original context; we keep it (as vLLM
does), and the prefix cache may hand a sequence blocks computed with the other set (a long
prompt's blocks to a short one sharing its prefix). Exact behaviour past the boundary needs the
scheduler to key cached blocks by factor set and recompute at the crossing.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.attention import AttentionBackend, AttentionMetadata
from pagedserve.worker.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from pagedserve.worker.ops import apply_rotary, gathered_rope
from pagedserve.worker.parallel import ColumnParallelLinear, Shard, copy_checked, even_shard, mark_loader

log = logging.getLogger(__name__)


class PackedColumnParallelLinear(ColumnParallelLinear):
    """A ColumnParallelLinear whose parts arrive as one checkpoint tensor, the parts stacked by rows
    (full sizes `full_sizes`): one weight_loader call fills every part's shard."""

    def __init__(self, in_features: int, shards: list[Shard], full_sizes: list[int]) -> None:
        super().__init__(in_features, shards)
        self.full_sizes = full_sizes
        self.full_offsets = [sum(full_sizes[:i]) for i in range(len(full_sizes))]
        mark_loader(self.weight, self._load_packed, 1)

    def _load_packed(self, param: nn.Parameter, loaded, part: int) -> None:
        if loaded.shape[0] != sum(self.full_sizes):
            expected = " + ".join(map(str, self.full_sizes))
            raise ValueError(f"a fused tensor of {loaded.shape[0]} rows, expected {expected}")
        for offset, full_offset, shard in zip(self.offsets, self.full_offsets, self.shards):
            rows = loaded.narrow(0, full_offset + shard.start, shard.size)
            copy_checked(param.data.narrow(0, offset, shard.size), rows)


def rope_settings(cfg: ModelConfig) -> dict:
    """config.json's rope settings (transformers 5 rope_parameters, or the older rope_scaling with
    top-level original_max_position_embeddings / partial_rotary_factor)."""
    hf = cfg.hf
    params = {"partial_rotary_factor": hf.get("partial_rotary_factor", 1.0),
              "original_max_position_embeddings": hf.get("original_max_position_embeddings")}
    params.update(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    return params


def longrope_tables(cfg: ModelConfig, rotary_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) float32 [2 * max_positions, rotary_dim]: the short factors' rows, then the long ones'."""
    params = rope_settings(cfg)
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or cfg.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    positions = torch.arange(max_positions, dtype=torch.float32)
    cos, sin = [], []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(params[key], dtype=torch.float32)
        if ext.numel() != rotary_dim // 2:
            raise ValueError(f"rope {key} has {ext.numel()} entries; the rotary dimension {rotary_dim} needs "
                             f"{rotary_dim // 2}")
        freqs = torch.outer(positions, 1.0 / (ext * cfg.rope_theta ** shape))
        emb = torch.cat((freqs, freqs), dim=-1)
        cos.append(emb.cos() * attention_factor)
        sin.append(emb.sin() * attention_factor)
    return torch.cat(cos), torch.cat(sin)


class Phi3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rotary_dim: int) -> None:
        super().__init__(cfg, backend)
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.qkv_proj = PackedColumnParallelLinear(cfg.hidden_size, self.qkv_proj.shards, [q_size, kv_size, kv_size])
        self.rotary_dim = rotary_dim

    def forward(self, hidden, rope, kv_cache, meta: AttentionMetadata):
        if self.rotary_dim == self.head_dim:
            return super().forward(hidden, rope, kv_cache, meta)
        # Partial rotary (Phi-4-mini): only the first rotary_dim dims of each head turn.
        num_tokens, ops, r = hidden.shape[0], self.ops, self.rotary_dim
        q, k, v = ops.linear(hidden, self.qkv_proj).split(self.split, dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q = torch.cat((apply_rotary(q[..., :r], *rope), q[..., r:]), dim=-1)
        k = torch.cat((apply_rotary(k[..., :r], *rope), k[..., r:]), dim=-1)
        attn = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return ops.linear(attn.reshape(num_tokens, -1), self.o_proj)


class Phi3MLP(LlamaMLP):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(hidden_size, intermediate_size)
        shard = even_shard(intermediate_size)
        self.gate_up_proj = PackedColumnParallelLinear(hidden_size, [shard, shard], [intermediate_size] * 2)


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        params = rope_settings(cfg)
        self.rotary_dim = int(cfg.head_dim * params.get("partial_rotary_factor", 1.0))
        self.longrope = (cfg.rope_scaling or {}).get("rope_type") == "longrope"
        self.original_max_positions = params.get("original_max_position_embeddings") or max_positions
        self.max_positions = max_positions
        if self.longrope and max_positions > self.original_max_positions:
            log.warning("LongRoPE: sequences past %d tokens switch to the long factors; their earlier KV "
                        "stays as computed (transformers recomputes it), and prefix-cache hits may mix the two "
                        "sets: --no-prefix-caching, or --max-model-len %d, for exact results",
                        self.original_max_positions, self.original_max_positions)
        super().__init__(cfg, backend, max_positions)

    def make_attention(self, layer_index: int, backend: AttentionBackend) -> nn.Module:
        return Phi3Attention(self.cfg, backend, self.rotary_dim)

    def make_mlp(self, layer_index: int) -> nn.Module:
        return Phi3MLP(self.cfg.hidden_size, self.cfg.intermediate_size)

    def init_rope(self, max_positions: int) -> None:
        if self.longrope:
            cos, sin = longrope_tables(self.cfg, self.rotary_dim, max_positions)
        else:
            shape = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), 1.0 / (self.cfg.rope_theta ** shape))
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        if self.rotary_dim != self.cfg.head_dim:  # ops.rotary turns whole heads only: the native rows
            return gathered_rope(self.cos_table, self.sin_table, positions, dtype)
        return super().rope(positions, dtype)

    @property
    def reads_layout_on_host(self) -> bool:
        """Long rope past the original length picks each prefill's table rows from its host lengths."""
        return self.longrope and self.max_positions > self.original_max_positions

    def table_rows(self, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Each token's row of the rope table: its position, plus max_positions where its sequence
        uses the long factors this step (see the module docstring)."""
        original = self.original_max_positions
        if not self.longrope or self.max_positions <= original:
            return positions
        use_long = positions >= original  # a decode: its own position decides
        for seq in meta.prefills:
            if seq.context_len + seq.query_len > original:
                use_long[seq.query_start:seq.query_start + seq.query_len] = True
        return positions + use_long.long() * self.max_positions

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        return super().forward(input_ids, self.table_rows(positions, meta), kv_caches, meta)

"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache, in the absorbed form.

The cache keeps per token only the compressed latent c_kv (kv_lora_rank = L values, after
kv_a_layernorm) and the rotated shared rope key k_pe (R values): [num_blocks, block_size, 1, L + R].
Keys and values are never expanded. The model folds the key half of kv_b_proj into the query
(q_latent = q_nope @ W_UK, per head), so a head's score against cached token j is
(q_latent . c_kv_j + q_rope . k_pe_j) * scale, and the values are c_kv itself: a backend returns
the latent output probs @ c_kv [T, H, L], which the model maps through the value half (W_UV).
"""

from __future__ import annotations

import abc

import torch

from pagedserve.worker.attention import AttentionMetadata, GraphSupport, PrefillSeq, kernel_metadata


class MLAAttentionBackend(abc.ABC):
    """Contract: `forward(q_latent [T, H, L], q_rope [T, H, R], latent_new [T, L], rope_new [T, R],
    latent_cache [num_blocks, block_size, 1, L + R], meta, scale)` writes the step's new tokens
    (latent then rope) into the cache at `meta.slot_mapping`, then returns [T, H, L] in q_latent's
    dtype: each token attends causally to its own sequence's cached context and the new tokens
    up to itself. Nothing but block ids addresses the cache. `graph_support` as attention.AttentionBackend's."""

    graph_support = GraphSupport.NEVER

    @abc.abstractmethod
    def forward(self, q_latent: torch.Tensor, q_rope: torch.Tensor, latent_new: torch.Tensor,
                rope_new: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor: ...


def write_latent_cache(latent_new: torch.Tensor, rope_new: torch.Tensor, latent_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    entries = torch.cat((latent_new, rope_new), dim=-1).to(latent_cache.dtype)
    latent_cache.view(-1, latent_cache.shape[-1]).index_copy_(0, slot_mapping, entries)


class TorchMLABackend(MLAAttentionBackend):
    """Plain torch ops (the CPU): decodes batched through their block tables, prefills one
    sequence at a time; scores and softmax in float32."""

    graph_support = GraphSupport.PURE_DECODE  # decodes read the lengths on the device

    def forward(self, q_latent, q_rope, latent_new, rope_new, latent_cache, meta, scale):
        write_latent_cache(latent_new, rope_new, latent_cache, meta.slot_mapping)
        rank = latent_new.shape[-1]
        out = torch.empty_like(q_latent)
        decodes = meta.num_decodes
        if decodes:
            out[:decodes] = self._decode(q_latent[:decodes], q_rope[:decodes], latent_cache, meta, scale, rank)
        for seq in meta.prefills:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            out[rows] = self._prefill(q_latent[rows], q_rope[rows], latent_new[rows], rope_new[rows],
                                      latent_cache, seq, scale)
        return out

    @staticmethod
    def _attend(q_latent, q_rope, c_kv, k_pe, allowed, scale):
        """q [B, H, L] / [B, H, R] against entries [B, N, L] / [B, N, R]; allowed [B, H or 1, N]."""
        scores = torch.matmul(q_latent, c_kv.transpose(1, 2)).float()
        scores += torch.matmul(q_rope, k_pe.transpose(1, 2)).float()
        scores = (scores * scale).masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(c_kv.dtype)
        return torch.matmul(probs, c_kv)

    def _decode(self, q_latent, q_rope, latent_cache, meta, scale, rank):
        tables = meta.decode_block_tables
        num_seqs = tables.shape[0]
        # [B, max_blocks, block_size, 1, L + R] -> [B, N, L + R]: only this batch's blocks.
        entries = latent_cache[tables].view(num_seqs, -1, latent_cache.shape[-1])
        span = torch.arange(entries.shape[1], device=entries.device)
        allowed = (span[None, :] < meta.decode_seq_lens[:, None]).unsqueeze(1)
        return self._attend(q_latent, q_rope, entries[..., :rank], entries[..., rank:], allowed, scale)

    def _prefill(self, q_latent, q_rope, latent_new, rope_new, latent_cache, seq: PrefillSeq, scale):
        rank = latent_new.shape[-1]
        total = seq.context_len + seq.query_len
        if seq.context_len == 0:
            c_kv, k_pe = latent_new.to(latent_cache.dtype), rope_new.to(latent_cache.dtype)
        else:
            entries = latent_cache[seq.block_ids].view(-1, latent_cache.shape[-1])[:total]
            c_kv, k_pe = entries[:, :rank], entries[:, rank:]
        positions = torch.arange(seq.context_len, total, device=q_latent.device)
        allowed = torch.arange(total, device=q_latent.device)[None, :] <= positions[:, None]
        # Heads as the batch: q [H, q_len, *] against the sequence's entries [1, total, *].
        out = self._attend(q_latent.transpose(0, 1), q_rope.transpose(0, 1), c_kv.unsqueeze(0),
                           k_pe.unsqueeze(0), allowed.unsqueeze(0), scale)
        return out.transpose(0, 1)


class TritonMLABackend(MLAAttentionBackend):
    """pagedserve/kernels/triton's paged MLA kernel (CUDA; the CPU under TRITON_INTERPRET=1); the new rows
    enter the cache through the fused KV write kernel (fused_ops.write_latent_cache). The step's
    metadata is converted once (all layers share it) into one row per sequence, decodes first."""

    graph_support = GraphSupport.PURE_DECODE  # kernel_metadata converts a pure decode step on the device

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._converted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._step_cache: dict = {}

    def forward(self, q_latent, q_rope, latent_new, rope_new, latent_cache, meta, scale):
        from pagedserve.kernels.triton import fused_ops
        from pagedserve.kernels.triton.mla_attention import paged_mla_attention

        if latent_new.stride(-1) == rope_new.stride(-1) == 1 and latent_cache.is_contiguous():
            fused_ops.write_latent_cache(latent_new, rope_new, latent_cache, meta.slot_mapping)  # one launch
        else:
            write_latent_cache(latent_new, rope_new, latent_cache, meta.slot_mapping)
        if self._meta is not meta:
            self._converted = kernel_metadata(meta, latent_cache.shape[1], latent_cache.device)
            self._meta, self._step_cache = meta, {}  # the kernel's tile maps: once a step
        block_tables, seq_lens, query_start_loc = self._converted
        return paged_mla_attention(q_latent, q_rope.contiguous(), latent_cache, block_tables, seq_lens,
                                   query_start_loc, scale, latent_new.shape[-1], step_cache=self._step_cache)

"""Sliding-window (local) attention over the paged KV cache, for the local layers of Gemma 3 and
any model that interleaves windowed and full attention.

A query at position p sees keys at positions p - window + 1 .. p (transformers'
`sliding_window_overlay`: kv_idx > q_idx - window). The backend is the torch one with that band
applied on top of the causal mask; it reads only the blocks that hold keys inside some query's
window (prefill) or masks the rest (decode), so entries of a block table that lie wholly before
the window are never relied on — the block manager releases them (their entries point at the null
block, or at a block since given to another sequence: read only under the mask; docs/sliding_window.md).

Decodes come in one of two layouts: with KV groups the model runner gives a sliding group's
decodes table rows that start at the window's first block (`meta.decode_windowed`), otherwise
whole-table rows from block 0. The model runner's metadata carries no mask: the torch backend builds
the windowed one from the lengths and `window` once per step (attention.decode_mask) and every local
layer reuses it. A metadata that brings its own mask (tests) has it windowed here, also once per
step: used as it is under the windowed layout. One instance per model, shared by its local layers.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedserve.worker.attention import AttentionMetadata, PrefillSeq, TorchAttentionBackend


class SlidingWindowAttention(TorchAttentionBackend):
    def __init__(self, window: int, softcap: float = 0.0) -> None:
        if window < 1:
            raise ValueError(f"sliding window must be at least 1 token, got {window}")
        self.window = window
        self.softcap = float(softcap or 0.0)  # Gemma 2's attention logit soft-capping (TorchAttentionBackend)
        self._meta: AttentionMetadata | None = None
        self._windowed: AttentionMetadata | None = None
        self._mask: tuple[torch.Tensor, torch.Tensor] | None = None  # (decode mask, windowed)

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        if meta.decode_mask is None:  # the base builds the windowed mask from the lengths
            return super().forward(query, key, value, k_cache, v_cache, meta, scale)
        return super().forward(query, key, value, k_cache, v_cache, self._windowed_meta(meta, k_cache.shape[1]), scale)

    def _windowed_meta(self, meta: AttentionMetadata, block_size: int) -> AttentionMetadata:
        """meta with the decode mask also hiding keys older than the window (built once a step)."""
        if self._meta is meta:
            return self._windowed
        if meta.decode_windowed:  # the runner laid the decodes out by the window already
            return meta
        windowed = meta
        if meta.num_decodes:
            if self._mask is None or self._mask[0] is not meta.decode_mask:
                span = meta.decode_mask.shape[-1]
                keys = torch.arange(span, device=meta.decode_mask.device)
                # the decoded token sits at seq_len - 1 and sees seq_len - window .. seq_len - 1
                stale = keys[None, :] < (meta.decode_seq_lens[:, None] - self.window)
                self._mask = (meta.decode_mask, meta.decode_mask.masked_fill(
                    stale.view(meta.num_decodes, 1, 1, span), float("-inf")))
            windowed = dataclasses.replace(meta, decode_mask=self._mask[1])
        self._meta, self._windowed = meta, windowed
        return windowed

    def _prefill(self, query, key, value, k_cache, v_cache, seq: PrefillSeq, scale):
        total = seq.context_len + seq.query_len
        if total <= self.window:  # no query here is old enough to lose a key
            return super()._prefill(query, key, value, k_cache, v_cache, seq, scale)
        num_kv_heads, head_dim, block_size = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
        # The earliest key any of this step's queries sees, and the block that holds it.
        first = max(0, seq.context_len - self.window + 1)
        if seq.context_len == 0:
            keys, values = key, value
        else:
            first_block = first // block_size
            skip = first_block * block_size
            blocks = seq.block_ids[first_block:-(-total // block_size)]
            keys = k_cache[blocks].view(-1, num_kv_heads, head_dim)[first - skip:total - skip]
            values = v_cache[blocks].view(-1, num_kv_heads, head_dim)[first - skip:total - skip]
        if seq.context_len == 0:
            first = 0
        key_pos = torch.arange(first, total, device=query.device)
        query_pos = torch.arange(seq.context_len, total, device=query.device)
        mask = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] > query_pos[:, None] - self.window)
        return self._attend(query, keys, values, mask, False, scale)

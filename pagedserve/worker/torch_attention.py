"""The attention backends of torch ops (the CPU's, and CUDA's reference under PAGEDSERVE_ATTENTION=torch) and of
the compiled CPU kernels (pagedserve/kernels/cpu), with their variants for layers with a sliding window
(SlidingWindowAttention) or soft-capped scores (SoftcapAttention): AttentionBackend.variant picks them, so a model
never names one. The contract and the step's metadata are attention.py's.

Threads: a backend is used only from the worker's torch thread (the model runner's), like the model itself; what
it builds once a step (the decode mask, the prefill kernel's layout) is kept with that step's metadata object.

Sliding windows. A query at position p sees keys at positions p - window + 1 .. p (transformers'
`sliding_window_overlay`: kv_idx > q_idx - window). The backend is the torch one with that band
applied on top of the causal mask; it reads only the blocks that hold keys inside some query's
window (prefill) or masks the rest (decode; the compiled decode kernel, where given, starts at the
window's first key), so entries of a block table that lie wholly before
the window are never relied on — the block manager releases them (their entries point at the null
block, or at a block since given to another sequence: read only under the mask; docs/sliding_window.md).

Bidirectional blocks (AttentionMetadata.key_limits, Gemma 3's images): a prefill query at p sees keys up to its
limit (p, or its image's last placeholder, computed in the same step) instead of p; the window still bounds the
first key; the compiled prefill kernel reads the limits too. A decode row
(one query) never sees past itself: a one-token chunk inside an image is its last placeholder.

Decodes come in one of two layouts: with KV groups the model runner gives a sliding group's
decodes table rows that start at the window's first block (`meta.decode_windowed`), otherwise
whole-table rows from block 0. The model runner's metadata carries no mask: the torch backend builds
the windowed one from the lengths and `window` once per step (attention.decode_mask) and every local
layer reuses it. A metadata that brings its own mask (tests) has it windowed here, also once per
step: used as it is under the windowed layout. One instance per model, shared by its local layers.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F

from pagedserve.worker.attention import (AttentionBackend, AttentionMetadata, GraphSupport, PrefillSeq, decode_mask,
                                         packed_prefills, windowed_decode_lens)


class TorchAttentionBackend(AttentionBackend):
    """Plain torch ops, for the CPU. Decodes run as two batched matmuls over grouped heads with a
    float32 softmax (torch's CPU SDPA is many times slower for one bf16 query); prefills go one
    sequence at a time through SDPA. The decode mask is built once per step from the sequence lengths
    (on the device: a decode step can be captured). With a window (SlidingWindowAttention's, or a
    CpuKernelAttentionBackend variant's), a prefill past it reads only the blocks from its first query's
    window on."""

    graph_support = GraphSupport.PURE_DECODE
    window = 0  # a sliding window, in tokens (0: none)
    # Gemma 2's attn_logit_softcapping: scaled scores become cap * tanh(scores / cap) before the mask
    # (0: none; SoftcapAttention sets it)
    softcap = 0.0
    _built_mask: tuple[AttentionMetadata, torch.Tensor] | None = None  # (the step's metadata, its mask)

    def variant(self, *, window: int = 0, softcap: float = 0.0) -> AttentionBackend:
        """Torch ops for either option."""
        if window:
            return SlidingWindowAttention(window, softcap)
        return SoftcapAttention(softcap) if softcap else self

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        self._write_kv(key, value, k_cache, v_cache, meta)
        if not meta.prefills and meta.num_decodes:  # a pure decode step: no output buffer to assemble
            return self._decode(query.contiguous(), k_cache, v_cache, meta, scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if meta.num_decodes:
            out[:meta.num_decodes] = self._decode(query[:meta.num_decodes].contiguous(), k_cache, v_cache,
                                                  meta, scale)
        if meta.prefills:
            self._prefills(query, key, value, k_cache, v_cache, meta, scale, out)
        return out

    def _write_kv(self, key, value, k_cache, v_cache, meta) -> None:
        """The step's new K/V rows into the cache at meta.slot_mapping."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)

    def _prefills(self, query, key, value, k_cache, v_cache, meta, scale, out) -> None:
        """Fill out's rows of every prefill chunk (the new K/V are already in the cache)."""
        limits = meta.key_limits
        for seq in meta.prefills:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            out[rows] = self._prefill(query[rows], key[rows], value[rows], k_cache, v_cache, seq, scale,
                                      None if limits is None else limits[rows])

    def _decode(self, query, k_cache, v_cache, meta, scale):
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        tables = meta.decode_block_tables
        # [B, L, KVH, D] -> [B, KVH, L, D]: gathers only this batch's blocks.
        keys = k_cache[tables].flatten(1, 2).transpose(1, 2)
        values = v_cache[tables].flatten(1, 2).transpose(1, 2)
        q = query.view(num_seqs, num_kv_heads, group, head_dim)
        scores = torch.matmul(q, keys.transpose(2, 3)).float() * scale
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores += self._decode_mask(meta, k_cache.shape[1])
        probs = torch.softmax(scores, dim=-1).to(query.dtype)
        return torch.matmul(probs, values).reshape(num_seqs, num_heads, head_dim)

    def _decode_mask(self, meta: AttentionMetadata, block_size: int) -> torch.Tensor:
        """meta's own mask, or the one built from its lengths (once per step: kept with the metadata)."""
        if meta.decode_mask is not None:
            return meta.decode_mask
        cached = self._built_mask
        if cached is None or cached[0] is not meta:
            cached = self._built_mask = (meta, decode_mask(meta, block_size, self.window))
        return cached[1]

    def _prefill(self, query, key, value, k_cache, v_cache, seq: PrefillSeq, scale, limits=None):
        """limits: the chunk's rows of meta.key_limits (None: causal)."""
        if self.window and seq.context_len + seq.query_len > self.window:  # some query is old enough to lose a key
            return self._windowed_prefill(query, key, value, k_cache, v_cache, seq, scale, limits)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        total = seq.context_len + seq.query_len
        if seq.context_len == 0:
            keys, values = key, value
        else:
            keys = k_cache[seq.block_ids].view(-1, num_kv_heads, head_dim)[:total]
            values = v_cache[seq.block_ids].view(-1, num_kv_heads, head_dim)[:total]
        if seq.context_len == 0 and limits is None:
            mask, causal = None, True
        else:
            last = torch.arange(seq.context_len, total, device=query.device) if limits is None else limits
            mask = torch.arange(total, device=query.device)[None, :] <= last[:, None]
            causal = False
        dtype = query.dtype
        if query.device.type == "cpu" and dtype == torch.bfloat16:
            # float32 arithmetic, as the CPU prefill kernel does for bfloat16: where it is missing
            # (no AVX-512), torch's bfloat16 SDPA moved the default model's greedy text
            # (tests/test_bf16_text.py) on an AVX2-only EPYC.
            query, keys, values = query.float(), keys.float(), values.float()
        return self._attend(query, keys, values, mask, causal, scale).to(dtype)

    def _windowed_prefill(self, query, key, value, k_cache, v_cache, seq: PrefillSeq, scale, limits=None):
        """A chunk past the window: only the blocks from its first query's window on, the band on top of the
        causal mask (or of limits: each query's last key)."""
        total = seq.context_len + seq.query_len
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
        last = query_pos if limits is None else limits
        mask = (key_pos[None, :] <= last[:, None]) & (key_pos[None, :] > query_pos[:, None] - self.window)
        return self._attend(query, keys, values, mask, False, scale)

    def _attend(self, query, keys, values, mask, causal: bool, scale: float) -> torch.Tensor:
        """One sequence's attention: query [T, H, D] over keys and values [S, KVH, D] (mask [T, S],
        True where a query sees a key; or causal), through SDPA; with a softcap, written out (SDPA
        has none), its scores in float32."""
        if not self.softcap:
            out = F.scaled_dot_product_attention(
                query.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=causal, scale=scale,
                enable_gqa=True)
            return out.squeeze(0).transpose(0, 1)
        group = query.shape[1] // keys.shape[1]
        k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        v = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(query.transpose(0, 1), k.transpose(1, 2)).float() * scale  # [H, T, S]
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if causal:
            mask = torch.ones(scores.shape[1:], dtype=torch.bool, device=scores.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs, v).transpose(0, 1)


class SoftcapAttention(TorchAttentionBackend):
    """The torch backend with Gemma 2's attention logit soft-capping (every step, decode and prefill)."""

    def __init__(self, softcap: float) -> None:
        if not softcap > 0:
            raise ValueError(f"attention softcap must be positive, got {softcap}")
        self.softcap = float(softcap)


class CpuKernelAttentionBackend(TorchAttentionBackend):
    """The compiled kernels of pagedserve/kernels/cpu: decodes read each cached row once, no
    gather; all of a step's prefill chunks go through one call (AVX-512, or AVX2 with FMA; float32
    and bfloat16), else one sequence at a time through SDPA as the torch backend does. The prefill kernel's
    layout (block tables and (row start, rows, context) per chunk) is built once per step and
    shared by every layer: the layers of a step get the same metadata object. Its variants (window, softcap)
    pass both options to the kernels; what the kernels do not take (a head dim, a group too wide) runs
    through the torch ops with the options too."""

    HEAD_DIMS = (32, 64, 80, 96, 128, 256)  # the sizes pagedserve/kernels/cpu/head_dims.h compiles in
    PREFILL_DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, ops, window: int = 0, softcap: float = 0.0) -> None:
        if window < 0 or softcap < 0:
            raise ValueError(f"window and softcap must be >= 0 (0: none), got {window} and {softcap}")
        self.ops = ops
        self.window, self.softcap = int(window), float(softcap)
        self.prefill_kernel = bool(getattr(ops, "prefill_attention_available", lambda: False)()) \
            and not os.environ.get("PAGEDSERVE_NO_PREFILL_KERNEL")
        # query heads per kv head it takes (48 with AVX-512, 24 with AVX2): more go through SDPA
        self.prefill_max_group = int(getattr(ops, "prefill_attention_max_group", lambda: 0)())
        self._layout: tuple[AttentionMetadata, int, torch.Tensor, torch.Tensor] | None = None
        self._lens: tuple[AttentionMetadata, torch.Tensor] | None = None  # (metadata, the kernel's decode lengths)

    def variant(self, *, window: int = 0, softcap: float = 0.0) -> AttentionBackend:
        return CpuKernelAttentionBackend(self.ops, window, softcap) if window or softcap else self

    def _write_kv(self, key, value, k_cache, v_cache, meta) -> None:
        if key.stride(-1) == 1 and key.stride(-2) == key.shape[-1] and value.stride(-1) == 1 \
                and value.stride(-2) == value.shape[-1] and k_cache.is_contiguous():
            self.ops.write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        else:
            super()._write_kv(key, value, k_cache, v_cache, meta)

    def _decode(self, query, k_cache, v_cache, meta, scale):
        if query.shape[-1] not in self.HEAD_DIMS:
            return super()._decode(query, k_cache, v_cache, meta, scale)
        if self._lens is None or self._lens[0] is not meta:  # once a step (a group's layers run one after another)
            self._lens = (meta, windowed_decode_lens(meta, k_cache.shape[1], self.window))
        return self.ops.paged_decode_attention(query, k_cache, v_cache, meta.decode_block_tables.contiguous(),
                                               self._lens[1], scale, self.window, self.softcap)

    def _prefills(self, query, key, value, k_cache, v_cache, meta, scale, out) -> None:
        if not (self.prefill_kernel and query.shape[-1] in self.HEAD_DIMS
                and query.dtype in self.PREFILL_DTYPES
                and query.stride(-1) == 1 and query.shape[1] // k_cache.shape[2] <= self.prefill_max_group):
            return super()._prefills(query, key, value, k_cache, v_cache, meta, scale, out)
        tables, chunks = self._prefill_layout(meta, k_cache.shape[1])
        self.ops.paged_prefill_attention(query, k_cache, v_cache, tables, chunks, scale, out, self.window, self.softcap,
                                         meta.key_limits)

    def _prefill_layout(self, meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_tables int64 [P, width], chunks int64 [P, 3]) for meta's prefills, zero-padded: the layout's
        views as they are (attention.packed_prefills)."""
        if self._layout is not None and self._layout[0] is meta and self._layout[1] == block_size:
            return self._layout[2], self._layout[3]
        chunks, tables = packed_prefills(meta, block_size, torch.device("cpu"))
        self._layout = (meta, block_size, tables, chunks)
        return tables, chunks


class SlidingWindowAttention(TorchAttentionBackend):
    """The torch backend with a sliding window (the module docstring); softcap: Gemma 2's score cap (0: none)."""

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

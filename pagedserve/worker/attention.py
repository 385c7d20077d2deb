"""Paged attention: a step's metadata (the runner's layout), the backends' contract (AttentionBackend: K/V are
read and written only through block tables) and the Triton backend (CUDA's; the CPU only under the
interpreter). The torch and compiled-CPU backends, and the windowed and soft-capped torch variants, are
torch_attention.py's."""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillSeq:
    query_start: int  # offset of its first scheduled token in the flattened batch
    query_len: int
    context_len: int  # tokens already in the cache before this step
    block_ids: torch.Tensor  # the blocks covering context_len + query_len tokens


@dataclass(slots=True)
class AttentionMetadata:
    """One step's layout. Tokens are flattened with all single-token queries (decodes) first."""
    slot_mapping: torch.Tensor  # [num_tokens] flat slot (block_id * block_size + offset) per token
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor | None  # [num_decodes] tokens attended, the new one included
    # [num_decodes, 1, 1, max_blocks * block_size] additive (0 / -inf); None (the runner's layout): a
    # backend that reads a mask builds it from decode_seq_lens (decode_mask below), once per step
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSeq]
    # A sliding KV group's decodes: each table row starts at the block holding the window's first
    # key (not block 0); a given decode_mask already hides keys outside the window.
    decode_windowed: bool = False
    # The prefills packed on the device (the runner's layout writes them; None for metadata built by hand:
    # packed_prefills builds them): [P, 3] (query_start, query_len, context_len) and [P, W] block tables
    # zero-padded to W = the widest chunk's ceil((context_len + query_len) / block_size); each
    # prefills[i].block_ids is then a view of row i.
    prefill_chunks: torch.Tensor | None = None
    prefill_tables: torch.Tensor | None = None
    # A step a mixed-step graph runs (graph_runner.MixedGraphRunner): every sequence, decodes included, in one
    # packed layout on the device, padded; then num_decodes is 0 and prefills is empty (no host value at all),
    # and only a backend whose graph_support is MIXED is handed such metadata.
    packed: PackedSeqs | None = None
    # Bidirectional blocks (Gemma 3's images: worker/image_rows.key_limits): int64 [num_tokens], the last key
    # position each of the step's queries may see, its own position or past it (to its image's last
    # placeholder, which the same step computes); a window still bounds the first. None: causal. Only an eager
    # step with image rows carries it; every backend's prefill path honours it (the torch ops, the CPU's compiled
    # prefill kernel, the Triton prefill kernel).
    key_limits: torch.Tensor | None = None


@dataclass(slots=True)
class PackedSeqs:
    """A step's sequences as device tensors alone (input_batch.layout_graph_mixed writes them), padded to a
    graph's bucket: sequence i's queries are rows query_start_loc[i]..query_start_loc[i + 1] of the step, it
    attends to seq_lens[i] positions (its new ones last) through block_tables[i]. A padding sequence owns the
    padding tokens (context 0, its table all block 0, their KV writes skipped: slot -1); the rows after it
    have no query and length 0."""
    query_start_loc: torch.Tensor  # int64 [S + 1]
    seq_lens: torch.Tensor  # int64 [S]
    block_tables: torch.Tensor  # int64 [S, W]


def packed_prefills(meta: AttentionMetadata, block_size: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunks int64 [P, 3], tables int64 [P, W]) of meta's prefills: the layout's own (views of the step's
    persistent inputs: nothing to do), or for metadata built by hand (the profiling step, tests) built from
    the PrefillSeq list, checked to follow the decodes contiguously, in order."""
    if meta.prefill_chunks is not None:
        return meta.prefill_chunks, meta.prefill_tables
    prefills = meta.prefills
    widths = [-(-(p.context_len + p.query_len) // block_size) for p in prefills]
    tables = torch.zeros(len(prefills), max(widths), dtype=torch.long, device=device)
    expected = meta.num_decodes
    for row, (seq, width) in enumerate(zip(prefills, widths)):
        if seq.query_start != expected:
            raise ValueError("prefill tokens must follow the decodes contiguously, in order")
        expected += seq.query_len
        used = seq.block_ids[:width]
        tables[row, :used.shape[0]] = used
    chunks = torch.tensor([(p.query_start, p.query_len, p.context_len) for p in prefills], dtype=torch.long)
    return chunks.to(device), tables


class GraphSupport(enum.IntEnum):
    """What of a step a backend lets a graph capture (after vLLM v1's AttentionCGSupport): the decode graph
    runner (graph_runner.py) captures only where every backend of the model says PURE_DECODE."""
    NEVER = 0  # its steps run eagerly
    PURE_DECODE = 1  # a step of single-token queries: reads only device tensors of the metadata, no host value
    MIXED = 2  # any step too, laid out packed (AttentionMetadata.packed): mixed and prefill steps are captured


def decode_mask(meta: AttentionMetadata, block_size: int, window: int = 0) -> torch.Tensor:
    """The additive decode mask [num_decodes, 1, 1, width * block_size] of meta's decode rows, built on the
    device from decode_seq_lens alone (no host value: it can be captured in a graph). A key is hidden past
    the sequence's length and, with a window, older than the window; a windowed layout's rows start at the
    block holding the window's first key (max(0, len - window) // block_size)."""
    lens = meta.decode_seq_lens
    span = meta.decode_block_tables.shape[1] * block_size
    keys = torch.arange(span, device=lens.device)[None, :]
    if meta.decode_windowed:
        keys = keys + (torch.clamp(lens - window, min=0) // block_size * block_size)[:, None]
    hidden = keys >= lens[:, None]
    if window:
        hidden |= keys < (lens - window)[:, None]
    mask = torch.zeros(lens.shape[0], 1, 1, span, device=lens.device)
    return mask.masked_fill_(hidden.view(lens.shape[0], 1, 1, span), float("-inf"))


class AttentionBackend(abc.ABC):
    """Contract: `forward` gets one layer's projected, rotated queries [T, H, D] and new keys and
    values [T, KVH, D] for the step's flattened tokens, writes the new K/V into that layer's
    cache at `meta.slot_mapping`, and returns the attention output [T, H, D], each token attending
    causally to its own sequence's cached context and the new tokens before it. The cache tensors
    are [num_blocks, block_size, KVH, D]; nothing but block ids addresses them. A backend builds whatever
    else it needs from the metadata itself, once per step (the layers of a step share one metadata object),
    and says in `graph_support` what of its steps a graph may capture."""

    graph_support = GraphSupport.NEVER

    @abc.abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor: ...

    def variant(self, *, window: int = 0, softcap: float = 0.0) -> AttentionBackend:
        """A backend of this one's kind for layers with a sliding window of `window` keys and/or their scaled
        scores soft-capped at `softcap` (0: none): a model asks its backend for one per kind of layer (so it
        never names a device's backend), and its layers of that kind share it (it builds its step's metadata
        once). Without either: this backend itself."""
        if window or softcap:
            raise ValueError(f"{type(self).__name__} has no sliding window or score soft-capping")
        return self


class TritonAttentionBackend(AttentionBackend):
    """pagedserve/kernels/triton's paged attention (CUDA; the CPU only under TRITON_INTERPRET=1): the decode
    kernel when every sequence has one query (split over the KV length when that fills the GPU better:
    kernels/triton/attention_choice.py), else the prefill/mixed kernel; the new K/V enter the cache
    through the fused write kernel (fused_ops.write_kv_cache) where each token's heads are contiguous.
    The step's metadata is converted once per step (all layers share it), and so are the kernels' tile maps.
    A mixed step's single-query sequences take the decode kernel and the others the prefill/mixed kernel
    (attention_choice.py), whose grids are upper bounds over the step's tokens and sequences: for a packed
    step (a mixed-step graph's) shapes alone decide everything it launches. A variant with a sliding window or
    score soft-capping (Gemma 2 and 3, Cohere 2) passes them to every kernel; a step's key_limits (Gemma 3's
    images, eager steps only) go to the prefill kernel."""

    graph_support = GraphSupport.MIXED  # kernel_metadata converts any step on the device, packed steps too

    def __init__(self, window: int = 0, softcap: float = 0.0) -> None:
        if window < 0 or softcap < 0:
            raise ValueError(f"window and softcap must be >= 0 (0: none), got {window} and {softcap}")
        self.window, self.softcap = int(window), float(softcap)
        self._meta: AttentionMetadata | None = None
        self._converted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._step_cache: dict = {}  # what the kernels build once a step (their tile maps): renewed with meta
        self._singles: bool | None = None

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        from pagedserve.kernels.triton.fused_ops import write_kv_cache
        from pagedserve.kernels.triton.attention_choice import paged_attention

        if key.stride(2) == 1 and key.stride(1) == key.shape[2] and value.stride(2) == 1 \
                and value.stride(1) == value.shape[2] and k_cache.is_contiguous() and v_cache.is_contiguous():
            write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)  # one launch for K and V
        elif meta.packed is not None:  # its padding tokens' slots are -1, which only the kernel skips
            raise ValueError("a packed step's KV write needs each token's heads contiguous")
        else:
            num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
            k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
            v_cache.view(-1, num_kv_heads, v_cache.shape[3]).index_copy_(0, meta.slot_mapping, value)
        if self._meta is not meta:
            self._converted = kernel_metadata(meta, k_cache.shape[1], k_cache.device, self.window)
            self._meta, self._step_cache = meta, {}
            # whether some sequence has one query (None: a packed step's split is made on the device)
            self._singles = None if meta.packed is not None else \
                bool(meta.num_decodes) or any(p.query_len == 1 for p in meta.prefills)
        return paged_attention(query, k_cache, v_cache, *self._converted, scale, step_cache=self._step_cache,
                               packed=meta.packed is not None, singles=self._singles, window=self.window,
                               softcap=self.softcap, key_limits=meta.key_limits)

    def variant(self, *, window: int = 0, softcap: float = 0.0) -> AttentionBackend:
        if not (window or softcap):
            return self
        return TritonAttentionBackend(window, softcap)


def windowed_decode_lens(meta: AttentionMetadata, block_size: int, window: int) -> torch.Tensor:
    """meta's decode lengths as the kernels take them: a windowed layout's rows (meta.decode_windowed) start at
    the block holding the window's first key, so each sequence is handed over shortened by the blocks its row
    skips (a kernel's window relates a query's and its keys' positions only, which the shift keeps)."""
    lens = meta.decode_seq_lens
    if meta.decode_windowed:
        lens = lens - torch.clamp(lens - window, min=0) // block_size * block_size
    return lens


def kernel_metadata(meta: AttentionMetadata, block_size: int, device: torch.device,
                    window: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block_tables int32 [S, max_blocks], seq_lens int32 [S], query_start_loc int32 [S + 1]) for
    the decodes then the prefills of `meta`. Rows are zero-padded to cover every sequence's length,
    so a table shorter than its sequence (the runner's profiling step) still reads valid blocks.
    A pure decode step and a packed one convert on the device alone (no host data): they can be captured in
    a graph. A windowed layout's decode rows are handed over shortened (windowed_decode_lens)."""
    if meta.packed is not None:
        packed = meta.packed
        return tuple(t.to(device=device, dtype=torch.int32)
                     for t in (packed.block_tables, packed.seq_lens, packed.query_start_loc))
    decodes = meta.num_decodes
    decode_lens = windowed_decode_lens(meta, block_size, window) if decodes else None
    if not meta.prefills:
        return (meta.decode_block_tables.to(device=device, dtype=torch.int32),
                decode_lens.to(device=device, dtype=torch.int32),
                torch.arange(decodes + 1, dtype=torch.int32, device=device))
    # A mixed or prefill step: a fixed number of device ops whatever the number of sequences (no loop over
    # them, no host read), from the packed prefills.
    chunks, prefill_tables = packed_prefills(meta, block_size, device)
    num_seqs = decodes + chunks.shape[0]
    width = prefill_tables.shape[1] if not decodes else max(prefill_tables.shape[1], meta.decode_block_tables.shape[1])
    tables = torch.zeros(num_seqs, width, dtype=torch.int32, device=device)
    tables[decodes:, :prefill_tables.shape[1]] = prefill_tables
    seq_lens = torch.empty(num_seqs, dtype=torch.int32, device=device)
    seq_lens[decodes:] = chunks[:, 1] + chunks[:, 2]
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)  # the decodes' rows: 0..decodes
    starts[decodes + 1:] = chunks[:, 0] + chunks[:, 1]
    if decodes:
        tables[:decodes, :meta.decode_block_tables.shape[1]] = meta.decode_block_tables
        seq_lens[:decodes] = decode_lens
    return tables, seq_lens, starts

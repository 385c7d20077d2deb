"""Which Triton paged attention kernel a step takes: the one rule, from shapes alone (no device sync, so a
decode graph captures the choice with the kernel).

- a step with prefill tokens (T > S), or any step laid out packed (a mixed-step graph's, where T may equal S):
  when some of its sequences may have exactly one query (decodes, or a one-token chunk), the decode kernel
  takes those and the prefill/mixed kernel the others (paged_mixed_attention: two launches, the split made on
  the device); when none has (a prefill step, as the eager layout knows), the prefill/mixed kernel alone;
- a pure decode step (T == S) whose plain decode kernel would run fewer programs (S x kv heads) than the
  GPU has multiprocessors, over block tables (a sliding window: over its window) spanning at least
  SPLIT_MIN_LEN positions: flash-decoding (split_decode.py), which adds up to 32 programs per (sequence,
  kv head) along the KV length and one small combine kernel;
- any other pure decode step: the plain decode kernel (enough programs to fill the GPU already).

The thresholds come from the kernels' shapes, not from a measurement: no GPU has yet timed where the split
pays (kernels.bench's 32K single-sequence case compares the two on the next GPU at hand). Under a decode
graph the tables are max_model_len wide, so a small batch takes the split kernel whatever its lengths;
runs past a sequence's end exit at once.

Threads: any (the multiprocessor count is read once per device and cached)."""

from __future__ import annotations

from functools import cache

import torch

from pagedserve.kernels.triton import paged_attention as plain
from pagedserve.kernels.triton.split_decode import decode_span, paged_split_decode_attention

SPLIT_MIN_LEN = 1024  # table span (positions) from which a split has at least two runs of 512 to spread


def use_split_decode(num_seqs: int, kv_heads: int, max_len: int, multiprocessors: int) -> bool:
    """Whether a pure decode step of num_seqs sequences over tables of max_len positions splits its KV length."""
    return max_len >= SPLIT_MIN_LEN and num_seqs * kv_heads < multiprocessors


@cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors; 0 off CUDA (the interpreter: never split unless a caller says)."""
    return _multiprocessors(device) if device.type == "cuda" else 0


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None, *,
                    sms: int | None = None, step_cache: dict | None = None, packed: bool = False,
                    singles: bool | None = None, window: int = 0, softcap: float = 0.0,
                    key_limits: torch.Tensor | None = None):
    """Causal attention of a step's tokens over the paged KV cache (contract in
    pagedserve.kernels.reference.paged_attention), through the kernel the rule above picks; `sms` stands in
    for the device's multiprocessor count (tests under the interpreter); `step_cache`: the step's layers
    share what is built once a step (kernels/triton's step_tiles); `packed`: a mixed-step graph's layout;
    `singles`: whether some sequence has exactly one query (None: may have); `window` (0: none) and `softcap`
    (0: none): the layer's sliding window and score soft-capping, which every kernel takes; `key_limits`
    (bidirectional blocks: AttentionMetadata.key_limits) the prefill kernel's (a decode never sees past itself)."""
    num_seqs = seq_lens.shape[0]
    if query.shape[0] == num_seqs and not packed:
        sms = multiprocessors(query.device) if sms is None else sms
        if use_split_decode(num_seqs, k_cache.shape[2], decode_span(block_tables, k_cache.shape[1], window), sms):
            return paged_split_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                                scale, out, window=window, softcap=softcap)
        return plain.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                            scale, out, window=window, softcap=softcap)
    if singles is False:
        return plain.paged_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                             out, step_cache=step_cache, window=window, softcap=softcap,
                                             key_limits=key_limits)
    return plain.paged_mixed_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                                       step_cache=step_cache, window=window, softcap=softcap, key_limits=key_limits)

"""Triton GPU kernels; each has a plain torch reference with the same signature in pagedserve/kernels/reference.py.

The modules import triton at top level: the worker imports them only on CUDA, and the tests run them
on the CPU under TRITON_INTERPRET=1. Block sizes shrink to 16 on CPU tensors (the interpreter is slow).

Integer arguments that change from step to step (a block table's row stride, the number of token/expert
pairs) are marked do_not_specialize: Triton otherwise compiles a kernel anew whenever such a value
becomes 1 or a multiple of 16, and an engine run compiles one variant after another. (On the H200 the
DeepSeek engine tests ended without an assertion, as tests killed at the GPU check's 120 s limit do,
12 processes compiling at once; the same tests pass here with the Triton MLA and MoE backends under
the interpreter, so compile time is the suspect the next GPU run confirms or clears.)"""

from __future__ import annotations

import numpy as np
import torch
import triton


def _fix_interpreter_scalar_index() -> None:
    """The Triton 3.6 interpreter turns a loaded scalar into a Python int with int() on a 1-element
    array, which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars", triton-lang/triton#9171), so `range(0, seq_len, BLOCK)` with a loaded seq_len fails.
    Re-patch __index__ the way upstream fixed it. Only the interpreter is touched."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_pagedserve_fixed", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patch_lang_tensor._pagedserve_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor


_fix_interpreter_scalar_index()


def is_interpreted(t: torch.Tensor) -> bool:
    """True when the kernels run under the Triton interpreter (CPU tensors), where small tiles keep tests fast."""
    return t.device.type != "cuda"


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 products for float32 inputs (tf32 would cost ~1e-3 relative
    error); for 16-bit inputs the setting has no effect and this is the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int) -> int:
    """triton.next_power_of_2 in plain Python (the smallest power of two >= n; 0 and 1 as they are): the
    wrappers compute their tiles on every call, and triton's goes through its constexpr machinery at
    ~4 us a call, several a kernel call on the eager path of a GPU step."""
    return n if n <= 1 else 1 << (n - 1).bit_length()


def pow2_tile(n: int) -> int:
    """A tile extent covering n: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, next_pow2(n))


def tile_map(query_start_loc: torch.Tensor, num_tokens: int, block_m: int, skip_singles: bool = False):
    """Map programs to query tiles without a host sync: tile i covers rows tile_start[i]..+block_m of
    sequence tile_seq[i] (rows relative to the sequence's first query row). The grid is sized to the
    upper bound cdiv(T, block_m) + S; surplus tiles get tile_seq = -1 and exit at once. skip_singles: a
    sequence with exactly one query gets no tile (another kernel takes it).

    Returns (tile_seq int32 [n], tile_start int32 [n], n)."""
    num_seqs = query_start_loc.shape[0] - 1
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    tiles = (q_lens + block_m - 1) // block_m
    if skip_singles:
        tiles = torch.where(q_lens == 1, 0, tiles)
    ends = torch.cumsum(tiles, 0)
    n = triton.cdiv(num_tokens, block_m) + num_seqs
    idx = torch.arange(n, device=query_start_loc.device)
    seq = torch.searchsorted(ends, idx, right=True)
    owner = seq.clamp(max=num_seqs - 1)
    start = (idx - (ends[owner] - tiles[owner])) * block_m
    tile_seq = torch.where(seq < num_seqs, seq, -1)
    return tile_seq.to(torch.int32), start.to(torch.int32), n


def step_tiles(step_cache: dict | None, query_start_loc: torch.Tensor, num_tokens: int, block_m: int,
               skip_singles: bool = False):
    """tile_map once per step: every layer's attention call of a step passes the same `step_cache` (a dict
    its backend renews with each step's metadata), so the ~8 small device ops run once a step instead of
    once a layer. None: no cache (a call on its own)."""
    if step_cache is None:
        return tile_map(query_start_loc, num_tokens, block_m, skip_singles)
    key = ("tiles", num_tokens, block_m, skip_singles)
    if key not in step_cache:
        step_cache[key] = tile_map(query_start_loc, num_tokens, block_m, skip_singles)
    return step_cache[key]

"""A step as the model runner lays out a sliding-window KV group (decodes first, then prefill chunks), for the
attention backends' tests: tests/test_triton_window_softcap.py and tests/test_cpu_window_softcap.py."""

from __future__ import annotations

import math

import torch

GARBAGE = 10**6  # a block id no pool holds: dereferencing it fails loudly (a fault)


def window_step(window: int, windowed_layout: bool, prefills=((3, 6), (12, 5), (0, 11)), device="cpu",
                decode_lens=(5, 14, 23), page=4, heads=4, kv_heads=2, dim=16, seed=5, released="null",
                dtype=torch.float32):
    """(query, key, value, (k_cache, v_cache), meta) of one step: with windowed_layout each decode row starts at
    the block holding its window's first key (input_batch.layout_step's decode_windowed), else at block 0.
    Every table entry wholly before a sequence's window (which the block manager gives back) names
    `released`: "null", a spare block of finite values (as the block manager's null block: the torch backend
    gathers whole decode rows from block 0); "nan", a spare block of NaNs (whoever reads it answers NaN); or
    "garbage", GARBAGE."""
    from pagedserve.worker.attention import AttentionMetadata, PrefillSeq

    gen = torch.Generator().manual_seed(seed)
    totals = list(decode_lens) + [c + q for c, q in prefills]
    counts = [math.ceil(n / page) for n in totals]
    num_blocks = sum(counts) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    spare = int(perm[-1])  # nobody's
    mark = GARBAGE if released == "garbage" else spare
    tables, used = [], 0
    for s, count in enumerate(counts):
        row = perm[used:used + count].clone()
        used += count
        first_query = totals[s] - 1 if s < len(decode_lens) else prefills[s - len(decode_lens)][0]
        row[:max(0, first_query - window + 1) // page] = mark
        tables.append(row.to(device))
    positions = [n - 1 for n in decode_lens] + [p for c, q in prefills for p in range(c, c + q)]
    owners = [*range(len(decode_lens))] + [len(decode_lens) + i for i, (_, q) in enumerate(prefills) for _ in range(q)]
    slots = torch.stack([tables[s][p // page] * page + p % page for s, p in zip(owners, positions)])
    num_decodes = len(decode_lens)
    rows = []
    for s, n in enumerate(decode_lens):
        first = max(0, n - window) // page if windowed_layout else 0
        rows.append(tables[s][first:])
    width = max(len(r) for r in rows)
    decode_tables = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])
    seqs, start = [], num_decodes
    for row, (context, count) in enumerate(prefills, start=num_decodes):
        seqs.append(PrefillSeq(start, count, context, tables[row]))
        start += count
    meta = AttentionMetadata(slots, num_decodes, decode_tables, torch.tensor(decode_lens, device=device), None, seqs,
                             decode_windowed=windowed_layout)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    query, key, value = (randn(len(positions), h, dim) for h in (heads, kv_heads, kv_heads))
    caches = randn(num_blocks, page, kv_heads, dim), randn(num_blocks, page, kv_heads, dim)
    if released == "nan":
        for cache in caches:
            cache[spare] = float("nan")
    return query, key, value, caches, meta

"""Paged attention backends against a dense reference: scattered block ids, odd lengths,
mixed decode + prefill-with-context steps."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels import cpu_ops
from pagedserve.worker.attention import AttentionMetadata, PrefillSeq
from pagedserve.worker.torch_attention import CpuKernelAttentionBackend, TorchAttentionBackend

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 32, 4


def dense_reference(q, keys, values, scale):
    """q [Q, H, D] attends causally to keys/values [L, KVH, D]; the queries are the last Q of L."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).float()
    v = values.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,lhd->hql", q.float(), k) * scale
    total, num_q = keys.shape[0], q.shape[0]
    allowed = torch.arange(total)[None, :] <= torch.arange(total - num_q, total)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)


def build_step(dtype, context_lens, query_lens, seed=0, heads=HEADS, kv_heads=KV_HEADS):
    """A pool with scattered blocks holding each sequence's context, plus the step's new tokens."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, DIM, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for ctx, qlen in zip(context_lens, query_lens):
        blocks = [free.pop() for _ in range(math.ceil((ctx + qlen) / BLOCK))]
        seqs.append((ctx, qlen, blocks))
    # decodes (query 1) first, as the runner orders them
    seqs.sort(key=lambda s: s[1] != 1)
    total = sum(q for _, q, _ in seqs)
    q = torch.randn(total, heads, DIM, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, DIM, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, DIM, generator=gen).to(dtype)
    slots, prefills, start = [], [], 0
    decodes = [s for s in seqs if s[1] == 1]
    for ctx, qlen, blocks in seqs:
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx, ctx + qlen)]
        if qlen > 1:
            prefills.append(PrefillSeq(start, qlen, ctx, torch.tensor(blocks)))
        start += qlen
    tables = lens = mask = None
    if decodes:
        width = max(len(b) for _, _, b in decodes)
        tables = torch.tensor([b + [0] * (width - len(b)) for _, _, b in decodes])
        lens = torch.tensor([c + 1 for c, _, _ in decodes])
        mask = torch.zeros(len(decodes), 1, 1, width * BLOCK)
        mask.masked_fill_((torch.arange(width * BLOCK)[None, :] >= lens[:, None]).view(len(decodes), 1, 1, -1),
                          float("-inf"))
    meta = AttentionMetadata(torch.tensor(slots), len(decodes), tables, lens, mask, prefills)
    return q, k, v, k_cache, v_cache, meta, seqs


def check_backend(backend, dtype, tol, context_lens=(0, 5, 13, 3, 0, 9, 30), query_lens=(1, 1, 1, 7, 5, 1, 4),
                  heads=HEADS, kv_heads=KV_HEADS):
    q, k, v, k_cache, v_cache, meta, seqs = build_step(dtype, context_lens, query_lens, heads=heads, kv_heads=kv_heads)
    scale = DIM ** -0.5
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    start = 0
    for ctx, qlen, blocks in seqs:
        flat_k = k_cache[torch.tensor(blocks)].flatten(0, 1)[:ctx + qlen]
        flat_v = v_cache[torch.tensor(blocks)].flatten(0, 1)[:ctx + qlen]
        # the step's own K/V were written through the slot mapping
        assert torch.equal(flat_k[ctx:], k[start:start + qlen])
        ref = dense_reference(q[start:start + qlen], flat_k, flat_v, scale)
        got = out[start:start + qlen].float()
        assert (got - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item()), (ctx, qlen)
        start += qlen


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_torch_backend(dtype, tol):
    check_backend(TorchAttentionBackend(), dtype, tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_cpu_kernel_backend(dtype, tol):
    ops = cpu_ops.load()
    if ops is None:
        pytest.skip("no C++ compiler for the CPU kernel here")
    check_backend(CpuKernelAttentionBackend(ops), dtype, tol)


def test_more_query_heads_per_kv_head_than_a_prefill_item_holds_take_sdpa():
    """A group wider than the prefill kernel's work item (its rows hold a token's whole group: 48
    with AVX-512, 24 with AVX2), as in a multi-query model of 64 heads: the backend sends those
    prefills to SDPA (the kernel refuses them) and the answer is the reference's."""
    ops = cpu_ops.load()
    if ops is None or not ops.prefill_attention_available():
        pytest.skip("no prefill kernel here (AVX-512, or AVX2 with FMA)")
    backend = CpuKernelAttentionBackend(ops)
    assert backend.prefill_max_group == ops.prefill_attention_max_group() > 0
    check_backend(backend, torch.float32, 1e-5, heads=backend.prefill_max_group + 2, kv_heads=1)
    check_backend(backend, torch.float32, 1e-5, heads=2 * backend.prefill_max_group, kv_heads=2)  # at the limit


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_pure_decode_steps(dtype, tol):
    """A step without prefills returns the decode output itself (no assembled buffer)."""
    check_backend(TorchAttentionBackend(), dtype, tol, (0, 5, 13, 40), (1, 1, 1, 1))
    ops = cpu_ops.load()
    if ops is not None:
        check_backend(CpuKernelAttentionBackend(ops), dtype, tol, (0, 5, 13, 40), (1, 1, 1, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_cache_is_index_copy_from_qkv_views(dtype):
    ops = cpu_ops.load()
    if ops is None:
        pytest.skip("no C++ compiler for the CPU kernel here")
    tokens, heads = 6, 5
    qkv = torch.randn(tokens, (heads + 2 * KV_HEADS) * DIM).to(dtype)  # the split's rows are strided
    _, k, v = (t.view(tokens, -1, DIM) for t in qkv.split([heads * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1))
    slots = torch.tensor([37, 3, 0, 63, 16, 15])
    blocks = 64 // BLOCK
    k_cache = torch.randn(blocks, BLOCK, KV_HEADS, DIM).to(dtype)
    v_cache = torch.randn(blocks, BLOCK, KV_HEADS, DIM).to(dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_k.view(-1, KV_HEADS, DIM).index_copy_(0, slots, k)
    ref_v.view(-1, KV_HEADS, DIM).index_copy_(0, slots, v)
    ops.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    with pytest.raises(RuntimeError, match="slot 64 is outside the cache's 64 slots"):
        ops.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 4, 64]))
    with pytest.raises(RuntimeError, match="one slot per token"):
        ops.write_kv_cache(k, v, k_cache, v_cache, slots[:5])
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.write_kv_cache(k.float() if dtype != torch.float32 else k.double(), v, k_cache, v_cache, slots)
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        ops.write_kv_cache(k.transpose(0, 1).contiguous().transpose(0, 1), v, k_cache, v_cache, slots)


def test_cpu_kernel_rejects_bad_shapes():
    ops = cpu_ops.load()
    if ops is None:
        pytest.skip("no C++ compiler for the CPU kernel here")
    cache = torch.zeros(4, BLOCK, KV_HEADS, DIM)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        ops.paged_decode_attention(torch.zeros(1, 3, DIM), cache, cache, torch.zeros(1, 1, dtype=torch.long),
                                   torch.ones(1, dtype=torch.long), 1.0)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("dim, heads, kv_heads, block", [(64, 9, 3, 16), (80, 4, 4, 8), (128, 8, 2, 5),
                                                          (32, 6, 1, 32), (256, 2, 1, 16), (64, 48, 2, 16)])
def test_decode_kernel_head_dims_and_chunk_edges(dtype, tol, dim, heads, kv_heads, block):
    """The decode kernel on every head dim it compiles in, against the dense reference: lengths
    around its 16-key chunks (AVX2: 8-key; 1, 7, 8, 9, 15, 16, 17, 33, 100), block sizes that do
    and do not divide 16, blocks scattered through the pool."""
    ops = cpu_ops.load()
    if ops is None:
        pytest.skip("no C++ compiler for the CPU kernel here")
    gen = torch.Generator().manual_seed(dim + block)
    lens = [1, 7, 8, 9, 15, 16, 17, 33, 100]
    widths = [math.ceil(n / block) for n in lens]
    num_blocks = sum(widths) + 7
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(widths), dtype=torch.long)
    for row, width in enumerate(widths):
        tables[row, :width] = torch.tensor([free.pop() for _ in range(width)])
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    scale = dim ** -0.5
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), scale)
    for row, n in enumerate(lens):
        keys = k_cache[tables[row, :widths[row]]].flatten(0, 1)[:n]
        values = v_cache[tables[row, :widths[row]]].flatten(0, 1)[:n]
        ref = dense_reference(q[row:row + 1], keys, values, scale)
        got = out[row:row + 1].float()
        assert (got - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item()), (n, dim, block)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("dim, heads, kv_heads, block", [(64, 9, 3, 16), (80, 4, 4, 8), (128, 8, 2, 5),
                                                          (32, 6, 1, 32), (256, 2, 1, 16), (64, 48, 2, 16)])
def test_prefill_kernel_head_dims_tiles_and_stale_rows(dtype, tol, dim, heads, kv_heads, block):
    """All of a step's prefill chunks in one call of the prefill kernel, against the dense
    reference: chunks with and without cached context, lengths around its 16-key tiles and its
    work items of 48 rows (AVX-512) or 24 (AVX2) (a group of 1 to 6 query heads per kv head, and
    a group that fills a whole item: 24), blocks scattered through the
    pool, every cache row that no chunk may read set to NaN (stale blocks, the tail of each last
    block), and the rows of `out` outside the chunks left as they were."""
    ops = cpu_ops.load()
    if ops is None or not ops.prefill_attention_available():
        pytest.skip("no prefill kernel here (AVX-512, or AVX2 with FMA)")
    gen = torch.Generator().manual_seed(dim + block + heads)
    chunks = [(0, 2), (0, 17), (15, 1), (16, 33), (31, 50), (100, 70), (0, 49)]
    widths = [math.ceil((c + n) / block) for c, n in chunks]
    num_blocks = sum(widths) + 5
    k_cache = torch.full((num_blocks, block, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(chunks), max(widths)), free[-1], dtype=torch.long)  # padding: a NaN block
    rows, start = [], 3  # three rows before the first chunk, e.g. decodes
    for i, ((ctx, n), width) in enumerate(zip(chunks, widths)):
        tables[i, :width] = torch.tensor([free.pop(0) for _ in range(width)])
        flat = tables[i, :width]
        keys = torch.randn(ctx + n, kv_heads, dim, generator=gen).to(dtype)
        values = torch.randn(ctx + n, kv_heads, dim, generator=gen).to(dtype)
        for t in range(ctx + n):
            k_cache[flat[t // block], t % block] = keys[t]
            v_cache[flat[t // block], t % block] = values[t]
        rows.append((start, n, ctx))
        start += n
    q = torch.randn(start + 2, heads, dim, generator=gen).to(dtype)
    out = torch.full_like(q, 7.0)
    scale = dim ** -0.5
    ops.paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(rows), scale, out)
    for i, (first, n, ctx) in enumerate(rows):
        flat = tables[i, :widths[i]]
        keys = k_cache[flat].flatten(0, 1)[:ctx + n]
        values = v_cache[flat].flatten(0, 1)[:ctx + n]
        ref = dense_reference(q[first:first + n], keys, values, scale)
        got = out[first:first + n].float()
        assert (got - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item()), (ctx, n, dim, block)
    untouched = torch.cat([out[:3], out[start:]])
    assert torch.equal(untouched, torch.full_like(untouched, 7.0))


def test_prefill_kernel_rejects_bad_layouts():
    ops = cpu_ops.load()
    if ops is None or not ops.prefill_attention_available():
        pytest.skip("no prefill kernel here (AVX-512, or AVX2 with FMA)")
    cache = torch.zeros(4, BLOCK, KV_HEADS, DIM)
    q = torch.zeros(5, HEADS, DIM)
    tables = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="chunks: contiguous int64"):
        ops.paged_prefill_attention(q, cache, cache, tables, torch.tensor([[0, 5]]), 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="out must be"):
        ops.paged_prefill_attention(q, cache, cache, tables, torch.tensor([[0, 5, 0]]), 1.0, torch.empty(5, HEADS, 8))
    most = ops.prefill_attention_max_group()
    assert most in (24, 48)  # 3 vectors of rows: AVX2's 8 lanes, AVX-512's 16
    wide = torch.zeros(5, most + 1, DIM)
    with pytest.raises(RuntimeError, match=f"at most {most} query heads per kv head"):
        ops.paged_prefill_attention(wide, torch.zeros(4, BLOCK, 1, DIM), torch.zeros(4, BLOCK, 1, DIM), tables,
                                    torch.tensor([[0, 5, 0]]), 1.0, torch.empty_like(wide))

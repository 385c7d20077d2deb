"""The Triton paged attention kernels with a sliding window and Gemma 2's score soft-capping (what Gemma 2 and 3
and Command R7B's layers run on CUDA), against the torch reference, the reference against naive dense attention,
the worker's Triton backend variants against the torch backends the models used to take everywhere, and a Gemma 2
engine on the Triton backend against transformers' greedy tokens. Without CUDA the kernels run under the Triton
interpreter; with CUDA natively (gpu/check.sh runs this file on the GPU).

Table entries wholly before the window's first key are garbage block ids here (the block manager gives such
entries back: a kernel must never read them), as are the entries past each sequence's end."""

from __future__ import annotations


import pytest
import torch

from triton_device import triton_device  # sets up the interpreter before triton.language is imported

DEVICE = triton_device()

from pagedserve.kernels import reference  # noqa: E402
from pagedserve.kernels.triton import attention_choice  # noqa: E402
from pagedserve.kernels.triton import paged_attention as tpa  # noqa: E402
from pagedserve.kernels.triton import split_decode as tsd  # noqa: E402
from window_steps import window_step  # noqa: E402
from test_triton_kernels import (  # noqa: E402
    GARBAGE,
    MIXED_LONG,
    MIXED_SINGLES,
    TOL,
    attention_step,
    dense_pages,
    rel_err,
)

# chunks with context past the window, a decode far past it, one inside it, a chunk from 0 crossing it
STEP = ([20, 0, 33, 3, 41], [9, 18, 1, 1, 6])
DECODES = ([0, 16, 45, 7, 70], [1, 1, 1, 1, 1])


def windowed_step(ctx_lens, q_lens, window, dtype, seed=0, heads=8, kv_heads=2, dim=40, dim_v=24, page=8):
    """attention_step's inputs with every table entry wholly before the step's first query's window made
    garbage: nothing may read it."""
    query, k_cache, v_cache, tables, seq_lens, qsl, scale = attention_step(
        ctx_lens, q_lens, heads, kv_heads, dim, dim_v, page, dtype, seed)
    for s, context in enumerate(ctx_lens):
        first_key = max(0, context - window + 1)
        tables[s, :first_key // page] = GARBAGE
    return query, k_cache, v_cache, tables, seq_lens, qsl, scale


def test_reference_matches_naive_dense_attention():
    """The reference's window and cap against attention written out over whole pages, per head."""
    window, cap = 6, 1.5
    query, k_cache, v_cache, tables, seq_lens, qsl, scale = attention_step(*STEP, 4, 2, 24, 24, 8, torch.float32)
    got = reference.paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl, scale, window=window,
                                    softcap=cap)
    for s, (context, q_len) in enumerate(zip(*STEP)):
        total, rows = context + q_len, slice(int(qsl[s]), int(qsl[s + 1]))
        k = dense_pages(k_cache, tables[s], total).repeat_interleave(2, dim=1)
        v = dense_pages(v_cache, tables[s], total).repeat_interleave(2, dim=1)
        for h in range(4):
            scores = query[rows, h] @ k[:, h].T * scale
            scores = cap * torch.tanh(scores / cap)
            q_pos = torch.arange(context, total, device=DEVICE)[:, None]
            k_pos = torch.arange(total, device=DEVICE)[None, :]
            scores = scores.masked_fill((k_pos > q_pos) | (k_pos <= q_pos - window), float("-inf"))
            assert torch.allclose(got[rows, h], scores.softmax(-1) @ v[:, h], atol=1e-5)
    plain = reference.paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl, scale)
    assert rel_err(plain, got) > 0.1  # the options change the answer on these inputs


@pytest.mark.parametrize("dtype, tile", [(torch.float32, 16), (torch.float16, 64)])
@pytest.mark.parametrize("window, cap", [(16, 0.0), (0, 2.0), (7, 1.5)])
def test_prefill_and_mixed_kernels(dtype, tile, window, cap, monkeypatch):
    """The prefill kernel (every sequence's tiles), the mixed pair (decode kernel for the one-query sequences)
    and the dispatcher, at the interpreter's tiles and the GPU's; a causal split asked for is dropped under
    a window (no key tile is whole for every row)."""
    from pagedserve.kernels.triton import tuning
    real_resolve = tuning.resolve
    monkeypatch.setattr(tpa, "resolve", lambda kernel, key, device, default, given: real_resolve(
        kernel, key, device, {**default, **{k: tile for k in ("block_m", "block_n") if k in default}}, given))
    for ctx_lens, q_lens in (STEP, MIXED_SINGLES):
        args = windowed_step(ctx_lens, q_lens, window or 10**9, dtype, seed=2)
        want = reference.paged_attention(*args, window=window, softcap=cap)
        opts = dict(window=window, softcap=cap)
        assert rel_err(tpa.paged_prefill_attention(*args, **opts), want) < TOL[dtype]
        assert rel_err(tpa.paged_prefill_attention(*args, causal_split=1, **opts), want) < TOL[dtype]
        assert rel_err(tpa.paged_mixed_attention(*args, **opts), want) < TOL[dtype]
        assert rel_err(attention_choice.paged_attention(*args, **opts), want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window, cap", [(5, 0.0), (24, 0.0), (9, 1.5), (0, 1.0)])
def test_decode_kernels(dtype, window, cap):
    """A pure decode step through the plain decode kernel and flash-decoding's split (runs wholly before the
    window do no work), and the mixed kernel on it."""
    args = windowed_step(*DECODES, window or 10**9, dtype, seed=3)
    want = reference.paged_attention(*args, window=window, softcap=cap)
    opts = dict(window=window, softcap=cap)
    assert rel_err(tpa.paged_decode_attention(*args, **opts), want) < TOL[dtype]
    tables, page = args[3], args[1].shape[1]
    assert tsd.decode_span(tables, page, window) == (min(window, tables.shape[1] * page) if window
                                                     else tables.shape[1] * page)
    for splits in (1, 3, 7):  # under a window of 24 the runs share the window: two of them at 16 positions
        assert rel_err(tsd.paged_split_decode_attention(*args, num_splits=splits, **opts), want) < TOL[dtype]
    assert rel_err(attention_choice.paged_attention(*args, sms=10**6, **opts), want) < TOL[dtype]
    assert rel_err(tpa.paged_prefill_attention(*args, **opts), want) < TOL[dtype]


def test_a_windowed_layer_splits_over_its_window_only():
    """Flash-decoding's rule and plan read a sliding layer's window, not its table: a 512-key window over
    a 32K table is one plain decode program per (sequence, kv head); a 4K window splits into 8 runs."""
    tables = torch.zeros(1, 2048, dtype=torch.int32)  # 32K positions at 16 a block
    assert attention_choice.use_split_decode(1, 1, tsd.decode_span(tables, 16), 132)
    assert not attention_choice.use_split_decode(1, 1, tsd.decode_span(tables, 16, window=512), 132)
    assert tsd.split_plan(tsd.decode_span(tables, 16, window=4096), 64) == (8, 512)
    assert tsd.split_plan(tsd.decode_span(tables, 16), 64) == (32, 1024)


def test_without_options_the_kernels_answer_as_before():
    """window 0 and softcap 0 are the plain kernels: the reference's plain attention."""
    args = attention_step(*MIXED_LONG, 8, 2, 40, 24, 16, torch.float32, seed=1)
    want = reference.paged_attention(*args)
    assert rel_err(tpa.paged_attention(*args, window=0, softcap=0.0), want) < TOL[torch.float32]
    with pytest.raises(ValueError, match="window"):
        tpa.paged_attention(*args, window=-1)


# ------------------------------------------------------------------------------------------ the worker


@pytest.mark.parametrize("windowed_layout", [True, False])
@pytest.mark.parametrize("prefills", [((3, 6), (12, 5), (0, 11)), ()])
def test_worker_triton_variant_equals_the_torch_variant(windowed_layout, prefills):
    """TritonAttentionBackend's windowed, capped variant (CUDA's) against the torch backend's (the CPU's) on a
    sliding group's mixed and pure-decode steps, in both decode layouts; the KV writes equal too."""
    from pagedserve.worker.attention import TritonAttentionBackend
    from pagedserve.worker.torch_attention import TorchAttentionBackend

    window, cap = 6, 1.5
    query, key, value, caches, meta = window_step(window, windowed_layout, prefills, DEVICE,
                                                  released="garbage" if windowed_layout else "null")
    runs = []
    for backend in (TorchAttentionBackend().variant(window=window, softcap=cap),
                    TritonAttentionBackend().variant(window=window, softcap=cap)):
        k_cache, v_cache = (c.clone() for c in caches)
        runs.append((backend.forward(query, key, value, k_cache, v_cache, meta, 0.3), k_cache, v_cache))
    (want, k_want, v_want), (got, k_got, v_got) = runs
    assert rel_err(got, want) < TOL[torch.float32]
    assert torch.equal(k_want, k_got) and torch.equal(v_want, v_got)
    plain = TritonAttentionBackend().variant(window=window).forward(query, key, value, *caches, meta, 0.3)
    assert rel_err(plain, want) > 0.01  # the cap reached the kernels


def test_each_backend_gives_its_own_kind_of_variant():
    from pagedserve.worker.attention import TritonAttentionBackend
    from pagedserve.worker.torch_attention import (CpuKernelAttentionBackend, SlidingWindowAttention, SoftcapAttention,
                                                   TorchAttentionBackend)

    torch_backend = TorchAttentionBackend()
    assert torch_backend.variant() is torch_backend
    capped = torch_backend.variant(softcap=2.0)
    assert type(capped) is SoftcapAttention and capped.softcap == 2.0
    local = torch_backend.variant(window=8, softcap=1.5)
    assert type(local) is SlidingWindowAttention and (local.window, local.softcap) == (8, 1.5)
    compiled = CpuKernelAttentionBackend(ops=None)
    local = compiled.variant(window=8, softcap=1.5)
    assert type(local) is CpuKernelAttentionBackend and (local.window, local.softcap) == (8, 1.5)
    assert compiled.variant() is compiled
    triton_backend = TritonAttentionBackend()
    assert triton_backend.variant() is triton_backend
    local = triton_backend.variant(window=8, softcap=1.5)
    assert type(local) is TritonAttentionBackend and (local.window, local.softcap) == (8, 1.5)
    with pytest.raises(ValueError, match="window and softcap"):
        TritonAttentionBackend(window=-1)


def test_gemma2_on_the_triton_backend_equals_transformers(tmp_path, monkeypatch):
    """A Gemma 2 engine (window 8, score cap 1.5 in every layer) whose platform gives the Triton backend (CUDA's;
    interpreted here): every layer takes its Triton variant, and greedy tokens equal transformers' with chunked
    prefill (windowed decodes beside chunks in the local KV group), and with decode and mixed-step graphs (the
    stand-in: each KV group's rows whole from block 0, the local layers' kernels starting at the window)."""
    from pagedserve.worker.graph_runner import StandInGraph
    from pagedserve.worker.attention import TritonAttentionBackend
    from pagedserve.worker.platform import CpuPlatform
    from test_gemma3 import LENGTHS, MAX_NEW, PROMPTS, run
    from tiny_models import build_tiny_model, hf_greedy, make_engine

    folder = build_tiny_model(tmp_path, "gemma2")
    prompts = [p for p, n in zip(PROMPTS, LENGTHS) if n in (9, 44)]
    expected = hf_greedy(folder, prompts, MAX_NEW)
    monkeypatch.setattr(CpuPlatform, "attention_backend", lambda self: TritonAttentionBackend())
    with make_engine(folder, device=DEVICE, max_num_batched_tokens=16, enforce_eager=True) as engine:
        backends = [layer.self_attn.backend for layer in engine.runner.model.layers]
        got = run(engine, prompts)
    assert all(type(b) is TritonAttentionBackend for b in backends)
    assert [(b.window, b.softcap) for b in backends] == [(8, 1.5), (0, 1.5)] * 2
    assert got == expected
    with make_engine(folder, device=DEVICE, max_num_seqs=4, max_num_batched_tokens=16, enforce_eager=True) as engine:
        engine.runner.enable_decode_graphs(4, StandInGraph, 16)  # mixed-step graphs too: every step from a graph
        assert run(engine, prompts) == expected
        for graphs in (engine.runner.decode_graphs, engine.runner.mixed_graphs):
            assert graphs.groups == 2 and sum(g.replays for g in graphs.graphs.values()) > 0

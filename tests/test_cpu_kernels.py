"""The fused CPU kernels against the plain torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_ops
from pagedserve.worker.models.llama import apply_rotary

ops = cpu_ops.load()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler for the CPU kernels here")

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, inter", [(1, 8), (7, 37), (33, 1536)])
def test_silu_and_mul(dtype, tokens, inter):
    x = (torch.randn(tokens, 2 * inter) * 4).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    got = ops.silu_and_mul(x).float()
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_qkv_views(dtype):
    tokens, heads, kv_heads, dim = 11, 6, 2, 32
    positions = torch.tensor([0, 5, 3, 100, 7, 8, 9, 60, 1, 2, 77])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(128).float(), inv_freq)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    ref_q, ref_k = apply_rotary(q.float(), c, s), apply_rotary(k.float(), c, s)
    untouched = qkv[:, (heads + kv_heads) * dim:].clone()
    ops.rotary_inplace(q, k, cos, sin, positions)
    tol = TOLERANCE[dtype]
    assert torch.allclose(q.float(), ref_q, rtol=tol, atol=tol)
    assert torch.allclose(k.float(), ref_k, rtol=tol, atol=tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], untouched)  # v is left alone


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8])
def test_small_m_linear(rows):
    x, w = torch.randn(rows, 72), torch.randn(37, 72)
    assert torch.allclose(ops.small_m_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_small_m_linear_rejects_bad_input():
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.small_m_linear(torch.randn(2, 7), torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="float32"):
        ops.small_m_linear(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, hidden", [(1, 64), (7, 37), (33, 576)])
def test_rms_norm_with_and_without_residual(dtype, tokens, hidden):
    from pagedserve.worker.models.llama import RMSNorm

    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = (torch.randn(hidden) * 0.5 + 1).to(dtype)
    x, residual = (torch.randn(tokens, hidden) * 3).to(dtype), (torch.randn(tokens, hidden) * 3).to(dtype)
    tol = TOLERANCE[dtype]
    assert torch.allclose(ops.rms_norm(x, norm.weight, 1e-5).float(), norm(x).float(), rtol=tol, atol=tol)
    total = residual + x
    got = ops.rms_norm(x, norm.weight, 1e-5, residual)
    assert torch.equal(residual, total)  # the residual add happened in place, rounded as torch rounds it
    assert torch.allclose(got.float(), norm(total).float(), rtol=tol, atol=tol)
    if dtype == torch.bfloat16:  # rounded where transformers rounds: equal, not just close
        assert torch.equal(got, norm(total))


def test_rms_norm_rejects_bad_input():
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="residual must match"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-5, torch.randn(3, 8))


@pytest.mark.parametrize("n", [1, 7, 16, 17, 100, 49152])
def test_argmax_rows_is_torch_argmax(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=gen)
    x[1] = 3.0  # every element ties: the first index
    x[2, n // 2:] = x[2].max() + 1  # ties at the maximum: the first of them
    x[3] = float("-inf")
    x[4, n - 1] = float("nan")  # torch's argmax answers the (first) NaN
    x[5, :: max(1, n // 3)] = float("nan")
    x[6] = x[6].round()  # many ties across SIMD lanes
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))


def test_argmax_rows_rejects_bad_input():
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.argmax_rows(torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.argmax_rows(torch.zeros(4, 2).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(8, 8), (20, 3), (100, 8), (49152, 8)])
def test_logits_top_is_float_copy_and_topk(dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    x = (torch.randn(6, n, generator=gen) * 4).to(dtype)
    x[1] = x[1].sort().values  # rising: every vector changes the candidates
    x[2] = 1.0  # all ties
    out, top = ops.logits_top(x, k)
    assert out.dtype == torch.float32 and torch.equal(out, x.float())
    assert top.shape == (6, k) and all(len(set(row)) == k for row in top.tolist())
    # Ties may pick other indices than torch; the values picked are the same.
    assert torch.equal(out.gather(1, top).sort(1).values, x.float().topk(k, 1).values.sort(1).values)


def test_logits_top_rejects_bad_k():
    with pytest.raises(RuntimeError, match="k must be in 1..4"):
        ops.logits_top(torch.zeros(2, 4), 5)


def test_every_process_of_one_environment_builds_with_its_own_ninja(monkeypatch):
    """A process started without the environment activated found another ninja on PATH, whose log
    disagreed with the environment's: each rebuilt the kernels the other had built."""
    import os
    import sys
    from pathlib import Path

    from pagedserve.kernels import cpu_ops
    own = Path(sys.executable).parent
    if not (own / "ninja").exists():
        pytest.skip("no ninja beside this python")
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin"]))
    cpu_ops._prefer_own_ninja()
    assert os.environ["PATH"].split(os.pathsep) == [str(own), "/usr/bin", "/bin"]
    cpu_ops._prefer_own_ninja()  # once is enough
    assert os.environ["PATH"].split(os.pathsep)[:2] == [str(own), "/usr/bin"]

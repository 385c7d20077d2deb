"""The fused elementwise Triton kernels (pagedserve/kernels/triton/fused_ops.py) against their torch
references (pagedserve/kernels/reference.py), and the references against the models' own code. Without CUDA
the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before triton is first imported)."""

from __future__ import annotations


import pytest
import torch

from triton_device import triton_device  # sets up the interpreter before triton.language is imported

DEVICE = triton_device()

from pagedserve.kernels import reference  # noqa: E402
from pagedserve.kernels.triton import fused_ops  # noqa: E402

# bfloat16 rounding of one ulp on values of order 1 is 2^-8; float16 2^-11
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def close(got, want, dtype):
    return (got.float() - want.float()).abs().max().item() <= TOL[dtype] * max(1.0, want.float().abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm(dtype, with_residual, gemma):
    gen = torch.Generator().manual_seed(0)
    x, w = rand(gen, 5, 40, dtype=dtype), rand(gen, 40, dtype=dtype)
    res = rand(gen, 5, 40, dtype=dtype) if with_residual else None
    res_ref = res.clone() if with_residual else None
    got = fused_ops.rms_norm(x, w, 1e-6, res, gemma=gemma)
    want = reference.rms_norm(x, w, 1e-6, res_ref, gemma=gemma)
    assert got.dtype == dtype and close(got, want, dtype)
    if with_residual:  # the sum, stored in place, rounded as torch rounds it (the interpreter's float32 ->
        # bfloat16 cast truncates where a GPU rounds to nearest: one ulp apart there)
        exact = dtype != torch.bfloat16 or DEVICE == "cuda"
        assert torch.equal(res, res_ref) if exact else close(res, res_ref, dtype)


def test_rms_norm_reference_is_the_models_norm():
    from pagedserve.worker.models.gemma3 import GemmaRMSNorm
    from pagedserve.worker.models.llama import RMSNorm

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 24, generator=gen).bfloat16()
    for module, gemma in ((RMSNorm(24, 1e-5), False), (GemmaRMSNorm(24, 1e-5), True)):
        module.weight.data = torch.randn(24, generator=gen).to(module.weight.dtype)
        assert torch.equal(reference.rms_norm(x, module.weight.data, 1e-5, gemma=gemma), module(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [None, 16])
def test_rotary_inplace_on_views_of_a_fused_projection(dtype, rotary_dim):
    gen = torch.Generator().manual_seed(2)
    tokens, hq, hk, dim = 6, 4, 2, 24
    qkv = rand(gen, tokens, (hq + 2 * hk) * dim, dtype=dtype)
    angles = torch.outer(torch.arange(64, dtype=torch.float32), torch.rand(12, generator=gen))
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    positions = torch.tensor([0, 5, 63, 7, 7, 30], device=DEVICE)
    ref = qkv.clone()
    views = [t[:, :(hq + hk) * dim].split((hq * dim, hk * dim), -1) for t in (qkv, ref)]
    (q, k), (q_ref, k_ref) = [(a.view(tokens, hq, dim), b.view(tokens, hk, dim)) for a, b in views]
    fused_ops.rotary_inplace(q, k, cos, sin, positions, rotary_dim)
    reference.rotary_inplace(q_ref, k_ref, cos, sin, positions, rotary_dim)
    assert close(qkv, ref, dtype)
    assert torch.equal(qkv[:, (hq + hk) * dim:], ref[:, (hq + hk) * dim:])  # v untouched


def test_rotary_reference_is_the_models_rotary():
    from pagedserve.worker.models.llama import apply_rotary

    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(4, 2, 8, generator=gen), torch.randn(4, 1, 8, generator=gen)
    angles = torch.outer(torch.arange(16, dtype=torch.float32), torch.rand(4, generator=gen))
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    positions = torch.tensor([3, 0, 15, 9])
    want_q = apply_rotary(q, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    want_k = apply_rotary(k, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    reference.rotary_inplace(q, k, cos, sin, positions)
    assert torch.allclose(q, want_q, atol=1e-6) and torch.allclose(k, want_k, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_act_and_mul(dtype, activation):
    gen = torch.Generator().manual_seed(4)
    x = rand(gen, 7, 2 * 40, dtype=dtype)
    assert close(fused_ops.act_and_mul(x, activation), reference.act_and_mul(x, activation), dtype)


def test_act_and_mul_refuses_an_unknown_activation():
    with pytest.raises(ValueError, match="gelu_tanh"):
        fused_ops.act_and_mul(torch.zeros(1, 4, device=DEVICE), "relu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_skips_padding_slots(dtype):
    gen = torch.Generator().manual_seed(5)
    blocks, page, kvh, d, dv = 6, 4, 2, 24, 8
    k_cache, v_cache = rand(gen, blocks, page, kvh, d, dtype=dtype), rand(gen, blocks, page, kvh, dv, dtype=dtype)
    kv = rand(gen, 5, kvh * (d + dv), dtype=dtype)  # views into one projection, as the models hand them
    key, value = kv[:, :kvh * d].view(5, kvh, d), kv[:, kvh * d:].view(5, kvh, dv)
    slots = torch.tensor([3, 17, -1, 0, 23], device=DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, want_k, want_v, slots)
    fused_ops.write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_latent_cache_equals_the_torch_write(dtype):
    """MLA's cache rows (latent then rope key) through the KV write kernel, against the torch backend's write;
    a padding slot (-1) writes nothing."""
    from pagedserve.worker.mla_attention import write_latent_cache

    gen = torch.Generator().manual_seed(8)
    rank, rope_dim = 40, 8
    cache = rand(gen, 6, 4, 1, rank + rope_dim, dtype=dtype)
    projected = rand(gen, 5, rank + rope_dim, dtype=dtype)  # the latent as a view of the projection's rows
    latent, rope = projected[:, :rank], rand(gen, 5, rope_dim, dtype=dtype)
    slots = torch.tensor([3, 17, -1, 0, 23], device=DEVICE)
    want = cache.clone()
    keep = slots >= 0
    write_latent_cache(latent[keep], rope[keep], want, slots[keep])
    fused_ops.write_latent_cache(latent, rope, cache, slots)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_ops_bundle_equals_the_native_one(dtype):
    """The CUDA platform's ops (these kernels) against the native bundle the models are checked with."""
    from pagedserve.worker.ops import CudaOps, NativeOps

    gen = torch.Generator().manual_seed(7)
    cuda, native = CudaOps(), NativeOps()
    x, w, res = rand(gen, 4, 32, dtype=dtype), rand(gen, 32, dtype=dtype), rand(gen, 4, 32, dtype=dtype)
    res_native = res.clone()
    assert close(cuda.rms_norm(x, w, 1e-6, res), native.rms_norm(x, w, 1e-6, res_native), dtype)
    assert close(res, res_native, dtype)
    gate_up = rand(gen, 2, 3, 48, dtype=dtype)
    assert close(cuda.silu_and_mul(gate_up), native.silu_and_mul(gate_up), dtype)
    assert close(cuda.gelu_and_mul(gate_up), native.gelu_and_mul(gate_up), dtype)
    angles = torch.outer(torch.arange(32, dtype=torch.float32), torch.rand(8, generator=gen))
    cos, sin = torch.cat((angles, angles), -1).cos().to(DEVICE), torch.cat((angles, angles), -1).sin().to(DEVICE)
    positions = torch.tensor([1, 31, 4], device=DEVICE)
    q, k = rand(gen, 3, 4, 16, dtype=dtype), rand(gen, 3, 2, 16, dtype=dtype)
    want = native.rotary(q.clone(), k.clone(), native.rope(cos, sin, positions, dtype))
    got = cuda.rotary(q, k, cuda.rope(cos, sin, positions, dtype))
    assert close(got[0], want[0], dtype) and close(got[1], want[1], dtype)


def test_next_pow2_is_tritons():
    """The wrappers' plain-Python next_pow2 gives triton.next_power_of_2's values (0 and 1 included)."""
    import triton

    from pagedserve.kernels.triton import next_pow2
    assert [next_pow2(n) for n in range(5000)] == [triton.next_power_of_2(n) for n in range(5000)]

"""The grouped LoRA kernels (pagedserve/kernels/triton/lora.py) against a naive per-row loop in
torch, and through a LoraLayer against its torch path (grouped_delta, what the CPU runs): rows of
several adapters and of none, ranks below the slot width, a merged layer's parts. Under the
Triton interpreter on the CPU (natively with CUDA). float32 and float16 (no bfloat16: the
interpreter's is wrong)."""

from __future__ import annotations


import pytest
import torch

from triton_device import triton_device  # sets up the interpreter before triton.language is imported

DEVICE = triton_device()

from pagedserve.kernels.triton import lora as tlora  # noqa: E402
from pagedserve.worker.lora.layers import LoraBatch, LoraLayer  # noqa: E402
from pagedserve.worker.ops import CudaOps  # noqa: E402
from pagedserve.worker.parallel import ColumnParallelLinear, Shard  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shrink_and_expand_equal_a_per_row_loop(dtype):
    gen = torch.Generator().manual_seed(0)
    slots, rank, k, n, rows = 3, 8, 72, 40, 7
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    a = torch.randn(slots, rank, k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(slots, rank, n, generator=gen).to(DEVICE, dtype)
    row_slots = torch.tensor([2, -1, 0, 0, 1, -1, 2], dtype=torch.int32, device=DEVICE)
    out = torch.randn(rows, n + 10, generator=gen).to(DEVICE, dtype)
    expected_v = torch.zeros(rows, rank)
    expected = out.float().clone()
    for t, s in enumerate(row_slots.tolist()):
        if s >= 0:
            expected_v[t] = a[s].float() @ x[t].float()
            expected[t, 6:6 + n] += expected_v[t] @ b[s].float()
    v = tlora.sgmv_shrink(x, a, row_slots, block_k=32)
    torch.testing.assert_close(v.float().cpu(), expected_v, rtol=TOL[dtype], atol=TOL[dtype] * 10)
    tlora.sgmv_expand_(out, v, b, row_slots, 0, 6, block_n=16)
    torch.testing.assert_close(out.float().cpu(), expected.cpu(), rtol=TOL[dtype], atol=TOL[dtype] * 30)


def test_a_merged_layer_equals_its_torch_path():
    """q/k/v parts of different sizes, adapters of ranks 4 and 8 in slots of width 8, one part
    left out by an adapter: kernel_delta equals grouped_delta."""
    gen = torch.Generator().manual_seed(1)
    in_features, sizes = 48, [32, 16, 16]
    layer = ColumnParallelLinear(in_features, [Shard(0, s) for s in sizes])
    batch = LoraBatch()
    lora = LoraLayer(layer, [(0, 32), (32, 16), (48, 16)], in_features, 3, 8, batch, torch.float32,
                     torch.device(DEVICE))
    lora.set_slot(0, {0: (torch.randn(4, in_features, generator=gen), torch.randn(32, 4, generator=gen)),
                      2: (torch.randn(4, in_features, generator=gen), torch.randn(16, 4, generator=gen))})
    lora.set_slot(1, {p: (torch.randn(8, in_features, generator=gen), torch.randn(s, 8, generator=gen))
                      for p, s in enumerate(sizes)})
    row_slots = [1, -1, 0, 1, 0]
    batch.slots = 2
    batch.row_slots = torch.tensor(row_slots, dtype=torch.int32, device=DEVICE)
    mask = torch.zeros(len(row_slots), 2)
    for t, s in enumerate(row_slots):
        if s >= 0:
            mask[t, s] = 1
    batch.mask = mask.to(DEVICE)
    x = torch.randn(len(row_slots), in_features, generator=gen).to(DEVICE)
    base = torch.randn(len(row_slots), 64, generator=gen).to(DEVICE)
    expected = lora.grouped_delta(x, base.clone())
    got = lora.kernel_delta(x, base.clone(), tlora)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], base[1])  # the base row: nothing added
    # CUDA's ops bundle runs the kernels (the CPU's the torch path)
    torch.testing.assert_close(CudaOps().lora_delta(lora, x, base.clone()), got)

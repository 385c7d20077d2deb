"""top_p's nucleus in one Triton launch (pagedserve/kernels/triton/nucleus.py), the GPU's way for rows with top_p
alone (worker/truncation.py): against an exact float64 form of the rule and against the sort, rows by index,
every dtype the kernel reads. Without CUDA the kernel runs under the Triton interpreter (TRITON_INTERPRET=1,
set before triton is first imported)."""

from __future__ import annotations

import pytest
import torch

from triton_device import triton_device  # sets up the interpreter before triton.language is imported

DEVICE = triton_device()

from pagedserve.kernels.triton.nucleus import BISECTION_STEPS, ONE_BITS, nucleus_  # noqa: E402
from pagedserve.worker.truncation import truncate  # noqa: E402
from sampling_rows import mixed_truncation_rows  # noqa: E402

NEG_INF = float("-inf")


def exact_nucleus(row: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """The rule in float64: a token stays when the mass of the tokens more likely than it is below top_p
    (equal ones stay together). None when a token's mass lies within float32 rounding of top_p."""
    probs = row.double().softmax(-1)
    before = torch.stack([probs[probs > p].sum() for p in probs])
    if ((before - top_p).abs() < 1e-5).any():
        return None
    return before < top_p


def rows_of(seed: int, rows: int, vocab: int) -> tuple[torch.Tensor, list[float]]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * (0.5 + 4 * torch.rand(rows, 1, generator=gen))
    x[0, :12] += 15  # a peaked row: a nucleus of a few tokens
    x[1, 7:] = NEG_INF  # a row truncated before (top_k, a grammar): its -inf tokens stay out
    top_p = (torch.rand(rows, generator=gen) * 0.98 + 0.01).tolist()
    return x, top_p


def test_the_bisection_covers_every_pattern_up_to_one():
    assert torch.tensor(1.0).view(torch.int32).item() == ONE_BITS
    assert ONE_BITS + 2 <= 2 ** BISECTION_STEPS  # [-1, bits(1.0)] halved BISECTION_STEPS times: one pattern left


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernel_keeps_the_exact_nucleus(dtype):
    checked = 0
    for seed in range(4):
        x, top_p = rows_of(seed, 6, 515)  # 515: not a multiple of the block, the last one masked
        x = x.to(dtype)
        got = nucleus_(x.clone().to(DEVICE), torch.arange(6, device=DEVICE),
                       torch.tensor(top_p, device=DEVICE)).cpu()
        for r in range(6):
            want = exact_nucleus(x[r].float(), top_p[r])
            if want is None:
                continue
            kept = got[r] > NEG_INF
            assert torch.equal(kept, want), (seed, r, top_p[r], kept.sum().item(), want.sum().item())
            assert torch.equal(got[r][kept], x[r][kept])  # kept logits untouched
            checked += 1
    assert checked >= 20


def test_only_the_indexed_rows_change_and_edge_rows_stay():
    x, top_p = rows_of(5, 5, 300)
    x[2] = NEG_INF  # every token masked: left as it is
    top_p[3] = 1.0  # the whole row
    got = nucleus_(x.clone().to(DEVICE), torch.tensor([3, 2, 0], device=DEVICE),
                   torch.tensor([top_p[3], top_p[2], top_p[0]], device=DEVICE)).cpu()
    assert torch.equal(got[[1, 2, 3, 4]], x[[1, 2, 3, 4]])
    assert torch.equal(got[0] > NEG_INF, exact_nucleus(x[0], top_p[0]))
    assert nucleus_(x.to(DEVICE), torch.zeros(0, dtype=torch.long, device=DEVICE),
                    torch.zeros(0, device=DEVICE)).shape == x.shape


def test_equal_tokens_at_the_edge_stay_together():
    """Four tokens at .25: the sort keeps two of them for top_p .5 (which two is the sort's order); the kernel,
    whose rule reads probabilities and not places, keeps all four, and one token past a clear edge."""
    x = torch.log(torch.tensor([[0.25] * 4, [0.5, 0.3, 0.15, 0.05]]))
    got = nucleus_(x.clone().to(DEVICE), torch.arange(2, device=DEVICE), torch.tensor([0.5, 0.75], device=DEVICE))
    assert (got.cpu() > NEG_INF).tolist() == [[True] * 4, [True, True, False, False]]


def test_truncate_takes_the_kernel_for_top_p_rows_alone():
    """A batch of 700 tokens: top_p rows (peaked and flat) through the kernel, beside top_k rows (candidates),
    top_k past the candidates (the sort), min_p after top_p and untouched rows: the kept sets of the sort's way
    (nucleus_guesses=(), no kernel) and the kernel's way are equal row by row, and kept values unchanged."""
    vocab = 700
    rows, logits = mixed_truncation_rows(vocab, seed=3, wide_top_k=690)
    params = [p for _, p in rows]
    sorted_way = truncate(logits.clone(), params, nucleus_guesses=(), nucleus_kernel=False)
    kernel_way = truncate(logits.clone().to(DEVICE), params, nucleus_guesses=(), nucleus_kernel=True).cpu()
    assert torch.equal(kernel_way > NEG_INF, sorted_way > NEG_INF)
    kept = kernel_way > NEG_INF
    assert torch.equal(kernel_way[kept], logits[kept])
    assert torch.equal(kernel_way[4], logits[4])
    assert 1 < kept[1].sum() < vocab and kept[0].sum() < kept[1].sum()  # both top_p rows truncated, flat wider

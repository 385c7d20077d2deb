"""A batch of sampled rows mixing every truncation (tests/test_sampler.py, tests/test_triton_nucleus.py)."""

from __future__ import annotations

import torch

from pagedserve.common.sampling_params import SamplingParams


def mixed_truncation_rows(vocab: int, seed: int, wide_top_k: int) -> tuple[list[tuple[torch.Tensor, SamplingParams]],
                                                                              torch.Tensor]:
    """(rows, logits): top_p rows over peaked logits (a narrow nucleus) and flat ones (a wide one), top_k with
    and without top_p, a top_k past the candidates (wide_top_k), min_p after top_p, a row with nothing to
    truncate, a low temperature; logits [8, vocab] are each row's values over its temperature."""
    gen = torch.Generator().manual_seed(seed)
    peaked = torch.randn(vocab, generator=gen) * 4
    flat = torch.randn(vocab, generator=gen) * 0.05
    rows = [(peaked, SamplingParams(top_p=0.9)), (flat, SamplingParams(top_p=0.9)),
            (flat, SamplingParams(top_k=300, top_p=0.5)), (peaked, SamplingParams(top_k=5)),
            (flat, SamplingParams()), (peaked, SamplingParams(top_p=0.8, min_p=0.1)),
            (flat, SamplingParams(top_k=wide_top_k, top_p=0.95)), (flat, SamplingParams(top_p=0.3, temperature=0.5))]
    return rows, torch.stack([row / p.temperature for row, p in rows])

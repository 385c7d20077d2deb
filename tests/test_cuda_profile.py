"""bench throughput --profile's CUDA summary (pagedserve/bench/cuda_profile.py): the per-step arithmetic over
real torch.profiler events (on the CPU, where no CUDA kernel runs), and, on a GPU, the phases of a real engine."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pagedserve.bench.cuda_profile import profile_phases, summarize


def test_summarize_counts_per_step_on_real_profiler_events():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            torch.ones(64, 64) @ torch.ones(64, 64)
    got = summarize("decode", 4, 0.02, prof.key_averages())
    assert got.steps == 4 and got.wall_ms == pytest.approx(5.0)
    assert got.gpu_busy_ms == 0 and got.host_launches == 0 and got.gpu_kernels == 0 and got.top_ops == []
    assert got.busy_share == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_phases_on_a_gpu(tmp_path):
    from tiny_models import build_tiny_model, make_engine

    engine = make_engine(build_tiny_model(tmp_path / "llama"), device="cuda", max_num_seqs=8)
    prefill, decode = profile_phases(engine, batch=8, prompt_len=16, decode_steps=8)
    assert prefill.steps >= 1 and 7 <= decode.steps <= 9
    assert decode.gpu_kernels > 0 and 0 < decode.busy_share <= 1.5
    assert decode.host_launches < prefill.host_launches  # decode replays its CUDA graph

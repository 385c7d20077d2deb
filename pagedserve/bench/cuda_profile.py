"""`bench throughput --profile` on CUDA: where a step's time goes on a GPU, by step kind.

After the measured run, the engine runs two short phases under torch.profiler: a batch of prompts'
prefill (the mixed steps' shape) and then pure-decode steps of the same batch. For each phase it reports
the steps, the wall time per step, the GPU's busy time per step (the sum of its kernels' time: the share
of the step the GPU did work), the kernel launches the host issued per step (cudaLaunchKernel and the
like, a replayed CUDA graph counting as one), the kernels the GPU ran per step, and the operators that
took the most GPU time. On the CPU, --profile keeps timing each part of a step (worker/step_profile.py).

Threads: the caller's (the engine's)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


@dataclass
class PhaseProfile:
    kind: str
    steps: int
    wall_ms: float = 0.0  # per step
    gpu_busy_ms: float = 0.0  # per step
    host_launches: float = 0.0  # per step
    gpu_kernels: float = 0.0  # per step
    top_ops: list[tuple[str, float]] = field(default_factory=list)  # (name, GPU ms per step)

    @property
    def busy_share(self) -> float:
        return self.gpu_busy_ms / self.wall_ms if self.wall_ms else 0.0


def summarize(kind: str, steps: int, wall_s: float, events, top: int = 8) -> PhaseProfile:
    """A phase's per-step figures from the profiler's key_averages()."""
    kernels = [e for e in events if getattr(e.device_type, "name", "") == "CUDA"]
    busy_us = sum(e.self_device_time_total for e in kernels)
    per = max(steps, 1)
    ops = sorted(((e.key, e.self_device_time_total) for e in kernels), key=lambda kv: -kv[1])[:top]
    return PhaseProfile(kind, steps, wall_s * 1e3 / per, busy_us / 1e3 / per,
                        sum(e.count for e in events if e.key in LAUNCH_CALLS) / per,
                        sum(e.count for e in kernels) / per, [(name, us / 1e3 / per) for name, us in ops])


def profile_phases(engine, batch: int = 64, prompt_len: int = 128, decode_steps: int = 32) -> list[PhaseProfile]:
    """Profile a prefill phase and a pure-decode phase of `batch` requests on the engine's GPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedserve.common.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=decode_steps + 1)
    for i in range(batch):
        engine.add_request(f"profile-{i}", [100 + (i * 7919 + j * 31) % (vocab - 100) for j in range(prompt_len)],
                           params)
    phases = []
    prefilling = lambda: len(engine.runner.requests) < batch or not _all_decoding(engine)  # noqa: E731
    for kind, condition in (("prefill", prefilling), ("decode", engine.has_unfinished)):
        torch.cuda.synchronize()
        steps, start = 0, time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            while engine.has_unfinished() and (steps == 0 or condition()):
                engine.step()
                steps += 1
        torch.cuda.synchronize()
        phases.append(summarize(kind, steps, time.perf_counter() - start, prof.key_averages()))
    while engine.has_unfinished():
        engine.step()
    return phases


def _all_decoding(engine) -> bool:
    """Every running request has its prompt computed: the next steps are pure decodes."""
    states = engine.runner.requests
    return all(s.num_computed_tokens >= s.num_prompt_tokens for s in states.values())


def print_phases(phases: list[PhaseProfile]) -> None:
    print("\nCUDA profile (torch.profiler), per step:")
    print(f"{'kind':<8} {'steps':>5} {'wall ms':>8} {'GPU busy ms':>11} {'busy':>6} {'host launches':>13} "
          f"{'GPU kernels':>11}")
    for p in phases:
        print(f"{p.kind:<8} {p.steps:>5} {p.wall_ms:>8.2f} {p.gpu_busy_ms:>11.2f} {p.busy_share:>6.0%} "
              f"{p.host_launches:>13.0f} {p.gpu_kernels:>11.0f}")
    for p in phases:
        print(f"  {p.kind}: " + "; ".join(f"{name[:48]} {ms:.3f} ms" for name, ms in p.top_ops))

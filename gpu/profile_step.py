"""Where a decode step's time goes on CUDA: wall, CPU-side, GPU kernel time and kernel launches per token."""
import sys
import time
import torch
from torch.profiler import profile, ProfilerActivity
from pagedserve import LLM, SamplingParams

model = sys.argv[1]
llm = LLM(model=model, device="cuda")
for batch in (1, 64):
    prompts = [{"prompt_token_ids": [100 + (i * 7 + j) % 40000 for j in range(128)]} for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts, sp)  # warm
    prompts = [{"prompt_token_ids": [200 + (i * 11 + j) % 40000 for j in range(128)]} for i in range(batch)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, sp)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ev = prof.key_averages()
    kernels = [e for e in ev if e.device_type.name == "CUDA"]
    n_k = sum(e.count for e in kernels)
    gpu_us = sum(e.self_device_time_total for e in kernels)
    host = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                                   "cuLaunchKernelEx", "cudaGraphLaunch"))
    print(f"\n=== batch {batch}: wall {wall*1e3:.0f} ms for 64 steps ({wall/64*1e3:.2f} ms/step under the profiler); "
          f"host launch calls (kernels + graph launches) {host} ({host/64:.0f}/step); GPU kernels run {n_k} "
          f"({n_k/64:.0f}/step); GPU busy {gpu_us/1e3:.1f} ms ({gpu_us/1e3/64:.2f} ms/step)")
    print(ev.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(ev.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))

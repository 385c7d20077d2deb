"""The engine's flags (model, device, dtype, KV pool, step budgets, parallelism), shared by every
command that builds or serves an engine."""

from __future__ import annotations

import argparse


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size: bytes or e.g. 512MiB, 2GiB (CPU default 2GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--swap-space", default="1GiB", help="host pool for --preemption-mode swap")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step, prefill chunks and decodes together "
                        "(default 512 on CPU, 2048 on CUDA)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="most prompt tokens one request prefills per step "
                        "(default max-num-batched-tokens/4; 0: no cap)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks the model is split across (ranks 1..N-1 run as extra processes)")

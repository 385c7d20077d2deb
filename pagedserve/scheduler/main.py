"""`pagedserve scheduler`: the step loop as a gRPC server (flags here; heavy imports in main)."""

from __future__ import annotations

import argparse

from pagedserve.common.store import DEFAULT_PREFIX, DEFAULT_TTL_S


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (internal service: keep it private)")
    parser.add_argument("--port", type=int, default=50060)
    parser.add_argument("--worker-addrs", default="127.0.0.1:50061",
                        help="comma-separated host:port of worker ranks 0..N-1")
    parser.add_argument("--redis-url", default=None, help="redis://host:port/db; unset or 'memory': in-process store")
    parser.add_argument("--redis-prefix", default=DEFAULT_PREFIX)
    parser.add_argument("--redis-ttl", type=int, default=DEFAULT_TTL_S, help="seconds a request record is kept")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="bound on the waiting queue: beyond it requests get RESOURCE_EXHAUSTED (HTTP 429)")
    parser.add_argument("--worker-timeout", type=float, default=600.0,
                        help="seconds to wait for the workers to load and answer")
    parser.add_argument("--orphan-timeout", type=float, default=60.0,
                        help="after a restart, seconds a re-admitted request waits for its stream to re-attach "
                             "before it is aborted")
    parser.add_argument("--step-timeout", type=float, default=60.0,
                        help="seconds a worker step may take before the rank counts as dead: the scheduler "
                             "then waits for the workers to come back and resumes every request by recompute")
    parser.add_argument("--stall-timeout", type=float, default=30.0,
                        help="health turns NOT_SERVING when work is pending and no step completed for this long")
    g = parser.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", default=None, help="KV pool size: bytes or e.g. 512MiB (CPU default 2GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--swap-space", default="1GiB", help="host pool for --preemption-mode swap")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default 512 on CPU, 2048 on CUDA)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")


def main(args: argparse.Namespace) -> int:
    from pagedserve.scheduler.server import serve
    return serve(args)

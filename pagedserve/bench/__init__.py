"""`pagedserve bench ...`: the benchmarks' command lines. Each bench module keeps torch out of its
import (it loads when the bench runs), so `pagedserve --help` and the services never load it."""

from __future__ import annotations

import argparse

from pagedserve.common.engine_args import add_engine_args


def parse_batch_sizes(text: str) -> list[int]:
    sizes = [int(s) for s in text.split(",") if s.strip()]
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return sizes


def _lora_bench(args) -> dict:
    from pagedserve.bench.lora_bench import run
    return run(args)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    from pagedserve.bench.throughput import __doc__ as throughput_doc
    from pagedserve.bench.throughput import run_throughput

    bench = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command",
                                     metavar="{throughput,latency,services,embeddings,tp,moe,serve,structured,vllm-cpu,llama-cpp,"
                                     "quality}")
    bench_sub.required = True
    p = bench_sub.add_parser("throughput", help="offline throughput vs transformers' static batching",
                             description=throughput_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON here")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--baseline-batch-sizes", type=parse_batch_sizes, default=[8, 32],
                   help="comma-separated static batch sizes for the transformers baseline (default 8,32)")
    p.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    p.add_argument("--profile", action="store_true",
                   help="time each part of every engine step (matmuls, attention, sampler, metadata, ...) "
                        "and print them per step kind against their floors (costs a little speed); on CUDA, "
                        "after the run: kernel launches, GPU busy time and the top GPU operators per step, "
                        "prefill and pure-decode steps apart (torch.profiler)")
    p.add_argument("--loras", type=int, default=0, metavar="N",
                   help="instead: the workload on the base model and spread over N random LoRA adapters, "
                        "alternating in one engine (bench/lora_bench.py); no transformers baseline")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the requests at this temperature (default 0: greedy; the baseline stays greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="the requests' top_p (with --temperature; default 1)")
    p.add_argument("--top-k", type=int, default=-1, help="the requests' top_k (with --temperature; default -1: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="the requests' repetition_penalty (greedy or sampled; default 1: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="the requests' presence_penalty (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="the requests' frequency_penalty (default 0)")
    p.add_argument("--lora-rank", type=int, default=16, help="the rank of --loras' adapters (default 16)")
    p.add_argument("--rounds", type=int, default=2, help="with --loras: base/LoRA runs of each (default 2)")
    add_engine_args(p)
    p.set_defaults(func=lambda args: _lora_bench(args) if args.loras else run_throughput(args))
    from pagedserve.bench.latency import add_latency_parser
    add_latency_parser(bench_sub)
    from pagedserve.bench.behind import add_behind_parser
    add_behind_parser(bench_sub)
    from pagedserve.bench.services import add_services_parser
    add_services_parser(bench_sub)
    from pagedserve.bench.embeddings import add_embeddings_parser
    add_embeddings_parser(bench_sub)
    from pagedserve.bench.tp import add_tp_parser
    add_tp_parser(bench_sub)
    from pagedserve.bench.moe import add_moe_parser
    add_moe_parser(bench_sub)
    from pagedserve.bench.scheduler_host import add_scheduler_parser
    add_scheduler_parser(bench_sub)
    from pagedserve.bench.layout_host import add_layout_parser
    add_layout_parser(bench_sub)
    from pagedserve.bench.sampler_host import add_sampler_parser
    add_sampler_parser(bench_sub)
    from pagedserve.bench.serve import add_serve_parser
    add_serve_parser(bench_sub)
    from pagedserve.bench.structured import add_structured_parser
    add_structured_parser(bench_sub)
    from pagedserve.bench.vllm_cpu import add_vllm_cpu_parser
    add_vllm_cpu_parser(bench_sub)
    from pagedserve.bench.llama_cpp import add_llama_cpp_parser
    add_llama_cpp_parser(bench_sub)
    from pagedserve.bench.quality import add_quality_parser
    add_quality_parser(bench_sub)
    return p

"""`pagedserve bench latency`: one stream through the in-process engine, the way `llama-bench`
measures a model: time to first token of an --input-len prompt, then --output-len greedy tokens
(ignore_eos) decoded one at a time. A GGUF model is served quantized unless --quantization none.

Prints and (--json) writes decode_tokens_per_s, ttft_ms, prefill_tokens_per_s, ttft_cpu_ms (the
process's CPU time to the first token),
decode_cpu_ms_per_token (the process's CPU time per token: with OMP_NUM_THREADS=1 the number to
compare on a shared machine, where wall time includes other processes' turns), rss_mib (the
process's resident memory after the run: weights, KV pool, kernels), weight_mib (what a decode
step reads of weights) and weight_read_gb_per_s (that times the decode rate: how close a step is
to the machine's memory bandwidth). Prompt ids: numpy.random.default_rng(0) over [100, vocab) for
the measured run, seeds 1, 2, ... for the warm-ups (a repeated prompt would be a prefix-cache hit).

--dataset grounded: the prompt asks to repeat a piece of code with one change (bench/grounded.py;
--input-len is then the prompt's own length), the workload of n-gram speculation. With
--speculative-config the results add the measured run's spec_decode counters: drafts, draft and
accepted tokens, acceptance rate, mean acceptance length (1 + accepted / drafts), and spec_method
(ngram, or draft_model and the draft's folder name). With a draft model, weight_mib counts the
draft's weights too.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from pagedserve.common.gc_heap import frozen_heap
from pagedserve.bench.grounded import grounded_token_ids
from pagedserve.common.engine_args import add_engine_args
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.speculative import parse_speculative_config


def spec_delta(before: dict, after: dict) -> dict:
    """The spec_decode counters of one run (after - before), with its rates."""
    drafts = after["num_drafts"] - before["num_drafts"]
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0}


def run_latency(args: argparse.Namespace) -> int:
    import torch

    from pagedserve.bench.throughput import build_engine, load_tokenizer, rss_mib
    from pagedserve.model_files.default_model import resolve_model

    model_path = resolve_model(args.model, args.revision)
    engine = build_engine(args, model_path, load_tokenizer(model_path))
    try:
        runner = engine.runner
        vocab = engine.model_config.vocab_size
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
        for warm in range(args.warmup + 1):  # the last run is the measured one
            # each warm-up its own prompt: the measured one must not find its prefix cached
            seed = 0 if warm == args.warmup else 1 + warm
            if args.dataset == "grounded":
                prompt = grounded_token_ids(engine.tokenizer, seed)
            else:
                prompt = np.random.default_rng(seed).integers(100, vocab, args.input_len).tolist()
            spec_before = engine.spec_decode_stats().get("spec_decode")
            engine.add_request(f"latency-{warm}", prompt, params)
            start = time.perf_counter()
            start_cpu = time.process_time()
            token_times: list[float] = []
            cpu_times: list[float] = []  # process CPU time: what a shared machine's wall clock hides
            with frozen_heap():  # as LLMEngine.generate
                while engine.has_unfinished():
                    for out in engine.step():
                        token_times.extend(time.perf_counter() for _ in out.new_tokens)
                        cpu_times.extend(time.process_time() for _ in out.new_tokens)
        if len(token_times) != args.output_len:
            raise RuntimeError(f"produced {len(token_times)} tokens, expected {args.output_len}")
        ttft = token_times[0] - start
        decode_s = token_times[-1] - token_times[0]
        decode_rate = (len(token_times) - 1) / decode_s if decode_s > 0 else float("nan")
        weight_bytes = runner.weight_bytes()
        result = {
            "model": str(model_path), "device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
            "quantization": runner.quantization, "linear_weights": runner.weights_description,
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "input_len": len(prompt), "output_len": args.output_len,
            "ttft_ms": ttft * 1e3, "prefill_tokens_per_s": len(prompt) / ttft,
            "ttft_cpu_ms": (cpu_times[0] - start_cpu) * 1e3,
            "decode_tokens_per_s": decode_rate, "decode_ms_per_token": 1e3 / decode_rate,
            "decode_cpu_ms_per_token": (cpu_times[-1] - cpu_times[0]) * 1e3 / max(1, len(cpu_times) - 1),
            "rss_mib": rss_mib(), "weight_mib": weight_bytes / 2**20,
            "weight_read_gb_per_s": weight_bytes * decode_rate / 1e9,
            "dataset": args.dataset,
        }
        if spec_before is not None:
            result["spec_decode"] = spec_delta(spec_before, engine.spec_decode_stats()["spec_decode"])
            spec_config = parse_speculative_config(args.speculative_config)
            result["spec_method"] = spec_config.method + (f" {Path(spec_config.model).name}" if spec_config.model
                                                          else "")
    finally:
        engine.close()
    print(f"{Path(result['model']).name} ({result['dtype']}, linear weights {result['linear_weights']}), "
          f"{result['threads']} threads: TTFT {result['ttft_ms']:.1f} ms ({result['ttft_cpu_ms']:.1f} ms CPU time) for "
          f"{result['input_len']} tokens, "
          f"decode {decode_rate:.1f} tok/s ({result['decode_ms_per_token']:.2f} ms/token, "
          f"{result['decode_cpu_ms_per_token']:.2f} ms CPU time/token; weights "
          f"{result['weight_mib']:.0f} MiB read at {result['weight_read_gb_per_s']:.1f} GB/s), "
          f"RSS {result['rss_mib']:.0f} MiB")
    spec = result.get("spec_decode")
    if spec is not None:
        print(f"speculative decoding ({result['spec_method']}): {spec['num_drafts']} drafts, "
              f"{spec['num_accepted_tokens']} of "
              f"{spec['num_draft_tokens']} proposed tokens accepted ({100 * spec['acceptance_rate']:.1f}%), "
              f"mean acceptance length {spec['mean_acceptance_length']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def add_latency_parser(bench_sub) -> None:
    p = bench_sub.add_parser("latency", help="one stream in process: time to first token and decode tokens/s",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=["random", "grounded"], default="random",
                   help="random token ids, or grounded: repeat a piece of code with one change (default random)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens of the random dataset (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens (default 128)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured runs first (default 1)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON here")
    add_engine_args(p)
    p.set_defaults(func=run_latency)

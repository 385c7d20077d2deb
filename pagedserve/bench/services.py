"""`pagedserve bench services`: the cost of the split. The same workload at the same concurrency
runs through the engine core in this process, then through the services (gateway, tokenizer,
scheduler, worker as processes, driven by streaming HTTP/SSE clients); reports the
throughput ratio, TTFT and TPOT of both (and the TPOT ratio: the one-stream target's measure), the
CPU each process spends per output token, the front end's share of the machine, and the
scheduler -> worker round trip beyond compute.

Workloads: `w64` (the throughput bench's W<num-prompts>) or `random` (prompts of --input-len random
token ids, --output-len tokens each, as vLLM's serving benchmark's random dataset). Greedy,
ignore_eos, one closed loop of --concurrency clients in both runs; each pair of runs on prompts of
its own (the same prompts again would be prefix-cache hits on both sides).

On a GPU the two sides are never resident together (Sides): each would take
--gpu-memory-utilization of it, and the services' worker would find the GPU held by this process.
The in-process engine is released (closed, collected, torch's cache emptied) before the services
start, and the services stopped before the engine is built again; the pairs then run in ABBA
order, so each switch serves two runs. On the CPU both stay up, as before.

Threads: the caller's, and asyncio's loop for the HTTP clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import numpy as np

from pagedserve.bench.sides import Sides, on_gpu, pair_order, scheduler_stats, start_services
from pagedserve.bench.throughput import Workload, build_engine, cpu_name, load_tokenizer, make_workload
from pagedserve.common.engine_args import add_engine_args
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.settings import setting

WARMUP_SEED = 2**31 - 1  # the warm-up's prompts: none of a run's (those take --seed + run)


def add_services_parser(bench_sub) -> None:
    p = bench_sub.add_parser("services", help="in-process engine vs the services at the same concurrency",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["w64", "random"], default="w64")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="random workload")
    p.add_argument("--output-len", type=int, default=64, help="random workload")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3,
                   help="alternating in-process / services pairs, each on fresh prompts (--seed + run)")
    p.add_argument("--redis-url", default=None, help="default: a private redis-server, as `pagedserve serve`")
    p.add_argument("--json", default=None, metavar="FILE")
    wait = setting("worker", "omp_wait_policy")
    p.add_argument("--omp-wait-policy", choices=wait.choices, default=wait.default,
                   help=f"the services' worker's (the in-process engine keeps the runtime's); default {wait.default}")
    pool = setting("worker", "cpu_kernel_threads")
    p.add_argument("--cpu-kernel-threads", choices=pool.choices, default=pool.default,
                   help=f"the services' worker's (the in-process engine keeps openmp); default {pool.default}")
    transport = setting("scheduler", "worker_transport")
    p.add_argument("--worker-transport", choices=transport.choices, default=transport.default,
                   help="the services' scheduler: " + transport.help)
    transport = setting("gateway", "service_transport")
    p.add_argument("--service-transport", choices=transport.choices, default=transport.default,
                   help="the services' gateway and tokenizer: " + transport.help)
    add_engine_args(p)
    p.set_defaults(func=run_services_bench)


def random_workload(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    return Workload([rng.integers(100, vocab_size, input_len).tolist() for _ in range(num_prompts)],
                    [output_len] * num_prompts)


def summarize(elapsed: float, ttfts: list[float], tpots: list[float], num_output: int) -> dict:
    return {"elapsed_s": elapsed, "output_tok_s": num_output / elapsed,
            "ttft_median_ms": 1e3 * statistics.median(ttfts), "tpot_median_ms": 1e3 * statistics.median(tpots),
            "ttft_mean_ms": 1e3 * statistics.fmean(ttfts), "tpot_mean_ms": 1e3 * statistics.fmean(tpots)}


# ---- in process ---------------------------------------------------------------------------------
def run_in_process(engine, work: Workload, concurrency: int) -> dict:
    """A closed loop of `concurrency` clients: a new request enters when one finishes."""
    pending = list(range(len(work.prompts)))[::-1]
    started: dict[str, float] = {}
    first: dict[str, float] = {}
    counts: dict[str, int] = {}
    ttfts, tpots = [], []
    t0 = time.perf_counter()

    def admit() -> None:
        i = pending.pop()
        rid = f"inproc-{i}"
        engine.add_request(rid, work.prompts[i], SamplingParams(temperature=0.0, ignore_eos=True,
                                                                 max_tokens=work.output_lens[i]))
        started[rid], counts[rid] = time.perf_counter(), 0

    for _ in range(min(concurrency, len(pending))):
        admit()
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            rid = out.request_id
            if out.new_tokens and rid not in first:
                first[rid] = now
            counts[rid] += len(out.new_tokens)
            if out.finished:
                ttfts.append(first[rid] - started[rid])
                tpots.append((now - first[rid]) / max(1, counts[rid] - 1))
                if pending:
                    admit()
    return summarize(time.perf_counter() - t0, ttfts, tpots, sum(counts.values()))


# ---- through the services -----------------------------------------------------------------------
async def run_clients(base_url: str, model: str, work: Workload, concurrency: int) -> dict:
    """Streaming completions over raw HTTP/SSE (httpx): the client parses only what it measures,
    so on a 2-core machine it takes as little CPU as it can from the server it measures."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    ttfts, tpots, produced = [], [], []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "prompt": work.prompts[i], "max_tokens": work.output_lens[i], "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        async with gate:
            start = time.perf_counter()
            first = None
            async with http.stream("POST", base_url + "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"request {i}: HTTP {response.status_code}: {await response.aread()!r}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if first is None:
                        first = time.perf_counter()
                    if '"usage":{' in line:
                        produced.append(json.loads(line[6:])["usage"]["completion_tokens"])
            end = time.perf_counter()
            ttfts.append(first - start)
            tpots.append((end - first) / max(1, work.output_lens[i] - 1))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=3600, limits=limits) as http:
        await asyncio.gather(*(one(http, i) for i in range(len(work.prompts))))
    elapsed = time.perf_counter() - t0
    if sum(produced) != work.num_output_tokens:
        raise RuntimeError(f"the services produced {sum(produced)} tokens, expected {work.num_output_tokens}")
    return summarize(elapsed, ttfts, tpots, sum(produced))


def service_cpu_seconds(stack) -> dict[str, float]:
    """CPU seconds (user + system, threads included) each service process has used so far. On a
    shared machine this is the steadiest measure of what a service costs: wall time swings with
    the load, the CPU a process burns per token much less."""
    import psutil

    used = {}
    for proc in stack.processes:
        if proc.proc is not None and proc.proc.poll() is None:
            times = psutil.Process(proc.proc.pid).cpu_times()
            used[proc.name] = used.get(proc.name, 0.0) + times.user + times.system
    return used


def cpu_ms_per_token(before: dict[str, float], after: dict[str, float], num_tokens: int) -> dict[str, float]:
    return {name: 1e3 * (after[name] - before.get(name, 0.0)) / num_tokens for name in after}


def run_services_bench(args) -> dict:
    from pagedserve.model_files.default_model import resolve_model

    model_path = resolve_model(args.model, args.revision)
    tokenizer = load_tokenizer(model_path)
    warm_up_prompts: list[Workload] = []
    served_model: list[str] = []  # the model's name on /v1/models

    def build() -> object:
        engine = build_engine(args, model_path, tokenizer)
        if not warm_up_prompts:
            warm_up_prompts.append(make_workload(4, engine.model_config.vocab_size, WARMUP_SEED))
        run_in_process(engine, warm_up_prompts[0], args.concurrency)  # warm-up: kernels, allocator
        return engine

    def start():
        import httpx
        stack = start_services(args, model_path)
        try:
            served_model[:] = [httpx.get(stack.http_url + "/v1/models", timeout=30).json()["data"][0]["id"]]
            asyncio.run(run_clients(stack.http_url, served_model[0], warm_up_prompts[0], args.concurrency))  # warm-up
        except BaseException:
            stack.stop()
            raise
        return stack

    # On a GPU one side at a time (Sides); on the CPU both stay up and the runs alternate: this
    # machine's speed drifts by 2x within minutes, so only pairs run back to back compare.
    sides = Sides(build, start, exclusive=on_gpu(args.device))
    engine = sides.engine()
    vocab, dtype = engine.model_config.vocab_size, str(engine.dtype).removeprefix("torch.")
    del engine  # Sides holds the only reference: it must be able to release it
    if not sides.exclusive:
        sides.stack()  # both up before the first pair

    def workload(seed: int) -> Workload:
        if args.workload == "w64":
            return make_workload(args.num_prompts, vocab, seed)
        return random_workload(args.num_prompts, args.input_len, args.output_len, vocab, seed)

    def in_process_run(work: Workload) -> dict:
        engine = sides.engine()
        cpu0 = time.process_time()
        result = run_in_process(engine, work, args.concurrency)
        result["cpu_ms_per_token"] = 1e3 * (time.process_time() - cpu0) / work.num_output_tokens
        return result

    def services_run(work: Workload) -> dict:
        stack = sides.stack()
        used0 = service_cpu_seconds(stack)
        used0["client"] = time.process_time()  # this process: the HTTP clients (the engine idles)
        result = asyncio.run(run_clients(stack.http_url, served_model[0], work, args.concurrency))
        result["cpu_ms_per_token"] = cpu_ms_per_token(
            used0, {**service_cpu_seconds(stack), "client": time.process_time()}, work.num_output_tokens)
        all_stats.append(scheduler_stats(stack))
        return result

    pairs = []
    all_stats = []  # the scheduler's, after each services run (a stack may not outlive its run)
    runs = {"in_process": in_process_run, "services": services_run}
    try:
        for repeat in range(args.repeats):
            # Fresh prompts in each pair: the same ones again would be prefix-cache hits on both sides
            # (a run of cached prompts is mostly decode, and measured 1.9x a cold one in process).
            work = workload(args.seed + repeat)
            pair = {side: runs[side](work) for side in pair_order(repeat, sides.exclusive)}
            in_process, services = pair["in_process"], pair["services"]
            pairs.append({"in_process": in_process, "services": services,
                          "ratio": services["output_tok_s"] / in_process["output_tok_s"],
                          "tpot_ratio": services["tpot_median_ms"] / in_process["tpot_median_ms"]})
            print(f"run {repeat + 1}: in-process {in_process['output_tok_s']:.1f} out tok/s, services "
                  f"{services['output_tok_s']:.1f}: {pairs[-1]['ratio']:.3f}x; TPOT "
                  f"{pairs[-1]['tpot_ratio']:.3f}x", flush=True)
    finally:
        sides.close()
    stats = all_stats[-1]
    ratios = sorted(p["ratio"] for p in pairs)
    result = {"cpu": cpu_name(), "dtype": dtype, "workload": args.workload, "num_prompts": len(work.prompts),
              "omp_wait_policy": args.omp_wait_policy, "cpu_kernel_threads": args.cpu_kernel_threads,
              "async_scheduling": not args.no_async_scheduling, "worker_transport": args.worker_transport,
              "service_transport": args.service_transport,
              "concurrency": args.concurrency, "output_tokens": work.num_output_tokens, "runs": pairs,
              "prompts_per_run": "fresh (seed + run)",
              "throughput_ratio_median": statistics.median(ratios),
              "step_rtt_median_ms": 1e3 * stats.step_rtt_median_s,
              "step_time_median_ms": 1e3 * stats.step_time_median_s}
    print(f"{'':12}{'out tok/s':>10}{'TTFT med ms':>13}{'TPOT med ms':>13}{'elapsed s':>11}   (median over runs)")
    for name in ("in_process", "services"):
        med = {key: statistics.median(p[name][key] for p in pairs)
               for key in ("output_tok_s", "ttft_median_ms", "tpot_median_ms", "elapsed_s")}
        result[name] = med
        print(f"{name:12}{med['output_tok_s']:10.1f}{med['ttft_median_ms']:13.1f}{med['tpot_median_ms']:13.1f}"
              f"{med['elapsed_s']:11.1f}")
    cpu = {name: statistics.median(p["services"]["cpu_ms_per_token"][name] for p in pairs)
           for name in pairs[0]["services"]["cpu_ms_per_token"]}
    result["services_cpu_ms_per_token"] = cpu
    result["in_process_cpu_ms_per_token"] = statistics.median(p["in_process"]["cpu_ms_per_token"] for p in pairs)
    result["tpot_ratio_median"] = statistics.median(p["tpot_ratio"] for p in pairs)
    # What the processes beside the worker (and this bench's clients) take of the machine, against
    # the core time a token takes in process: on a machine the worker's threads already fill, the
    # services cannot beat about in_process / (in_process + front end) (docs/performance.md).
    front = sum(ms for name, ms in cpu.items() if not name.startswith("worker"))
    machine_ms = (os.cpu_count() or 1) * 1e3 / result["in_process"]["output_tok_s"]
    result["front_end_cpu_ms_per_token"] = front
    result["front_end_share"] = front / machine_ms
    print("CPU ms per output token (median): in-process " + f"{result['in_process_cpu_ms_per_token']:.2f}; "
          + ", ".join(f"{name} {ms:.2f}" for name, ms in cpu.items()))
    print(f"front end (all but the worker, clients included): {front:.2f} ms CPU per token = "
          f"{100 * result['front_end_share']:.0f}% of the in-process engine's core time per token "
          f"({os.cpu_count()} cores)")
    print(f"services / in-process TPOT: median {result['tpot_ratio_median']:.3f}x")
    print(f"services / in-process throughput: median {result['throughput_ratio_median']:.3f}x over "
          f"{len(pairs)} alternating runs; scheduler->worker round trip beyond compute: median "
          f"{result['step_rtt_median_ms']:.2f} ms per step (median step {result['step_time_median_ms']:.1f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result

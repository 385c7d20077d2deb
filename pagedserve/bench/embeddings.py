"""`pagedserve bench embeddings`: embeddings per second, the in-process engine (LLM.embed's path)
against the services (`pagedserve serve --runner pooling`, POST /v1/embeddings), in one sitting.

Each run embeds --num-inputs prompts of --input-len random token ids: in process as one batch of
prefill-only requests (engine/embeddings.py), through the services as requests of --batch-size
inputs (base64, as the openai SDK asks), --concurrency of them at a time. Runs alternate between
the two sides, each pair on prompts of its own (the same prompts again would be prefix-cache hits
with the `last` pooler). Both sides run the same model, dtype and --pooler; the report also gives
the lowest cosine between the two sides' vectors of a run (the same kernels: ~1).

On a GPU the two sides take turns (bench services' Sides); on the CPU both stay up.
Threads: the caller's, and asyncio's loop for the HTTP clients.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import time

import numpy as np

from pagedserve.bench.sides import Sides, on_gpu, pair_order, start_services
from pagedserve.bench.throughput import build_engine, cpu_name, load_tokenizer
from pagedserve.common.engine_args import add_engine_args

WARMUP_SEED = 2**31 - 1


def add_embeddings_parser(bench_sub) -> None:
    p = bench_sub.add_parser("embeddings", help="embeddings per second: in-process engine vs the services",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-inputs", type=int, default=256)
    p.add_argument("--input-len", type=int, default=64, help="tokens per input")
    p.add_argument("--batch-size", type=int, default=256, help="inputs per POST /v1/embeddings")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    p.add_argument("--repeats", type=int, default=3, help="alternating in-process / services pairs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis-url", default=None, help="default: a private redis-server, as `pagedserve serve`")
    p.add_argument("--json", default=None, metavar="FILE")
    add_engine_args(p)
    p.set_defaults(func=run_embeddings_bench)


def random_inputs(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab_size, length).tolist() for _ in range(num)]


def embed_in_process(engine, inputs: list[list[int]], pooler: str, first_id: int) -> np.ndarray:
    from pagedserve.common.offline_types import PoolingParams
    from pagedserve.engine.embeddings import embed_all, pooling_request_params

    params = pooling_request_params("pooling", pooler, PoolingParams())
    ids = [f"bench-{first_id + i}" for i in range(len(inputs))]
    outs = embed_all(engine, ids, [(None, p) for p in inputs], params, use_tqdm=False)
    return np.array([o.outputs.embedding for o in outs], dtype=np.float32)


async def embed_through(base_url: str, model: str, inputs: list[list[int]], batch_size: int,
                        concurrency: int) -> np.ndarray:
    import httpx

    batches = [inputs[i:i + batch_size] for i in range(0, len(inputs), batch_size)]
    vectors: list[np.ndarray | None] = [None] * len(batches)
    queue = list(range(len(batches)))

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop(0)
            reply = await http.post("/v1/embeddings", json={"model": model, "input": batches[i],
                                                            "encoding_format": "base64"})
            reply.raise_for_status()
            vectors[i] = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                                   for d in reply.json()["data"]])

    async with httpx.AsyncClient(base_url=base_url, timeout=3600) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return np.concatenate(vectors)


def lowest_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(axis=1).min())


def run_embeddings_bench(args) -> dict:
    import httpx

    from pagedserve.model_files.default_model import resolve_model

    args.runner = "pooling"
    model_path = resolve_model(args.model, args.revision)
    tokenizer = load_tokenizer(model_path)
    served: list[str] = []
    counter = [0]

    def next_id() -> int:
        counter[0] += args.num_inputs
        return counter[0]

    def build():
        engine = build_engine(args, model_path, tokenizer)
        embed_in_process(engine, random_inputs(8, args.input_len, engine.model_config.vocab_size, WARMUP_SEED),
                         args.pooler, next_id())
        return engine

    def start():
        stack = start_services(args, model_path, runner="pooling", pooler=args.pooler)
        try:
            served[:] = [httpx.get(stack.http_url + "/v1/models", timeout=30).json()["data"][0]["id"]]
            asyncio.run(embed_through(stack.http_url, served[0], random_inputs(8, args.input_len, 1000, WARMUP_SEED),
                                      8, 1))
        except BaseException:
            stack.stop()
            raise
        return stack

    sides = Sides(build, start, exclusive=on_gpu(args.device))
    engine = sides.engine()
    vocab, dtype = engine.model_config.vocab_size, str(engine.dtype).removeprefix("torch.")
    del engine
    if not sides.exclusive:
        sides.stack()

    def in_process(inputs):
        t0 = time.perf_counter()
        vectors = embed_in_process(sides.engine(), inputs, args.pooler, next_id())
        return time.perf_counter() - t0, vectors

    def services(inputs):
        stack = sides.stack()
        t0 = time.perf_counter()
        vectors = asyncio.run(embed_through(stack.http_url, served[0], inputs, args.batch_size, args.concurrency))
        return time.perf_counter() - t0, vectors

    runs, sides_run = [], {"in_process": in_process, "services": services}
    try:
        for repeat in range(args.repeats):
            inputs = random_inputs(args.num_inputs, args.input_len, vocab, args.seed + repeat)
            pair = {side: sides_run[side](inputs) for side in pair_order(repeat, sides.exclusive)}
            run = {side: args.num_inputs / pair[side][0] for side in pair}
            run["ratio"] = run["services"] / run["in_process"]
            run["lowest_cosine"] = lowest_cosine(pair["in_process"][1], pair["services"][1])
            runs.append(run)
            print(f"run {repeat + 1}: in-process {run['in_process']:.1f} embeddings/s, services "
                  f"{run['services']:.1f}: {run['ratio']:.3f}x (lowest cosine between them {run['lowest_cosine']:.6f})",
                  flush=True)
    finally:
        sides.close()
    result = {"cpu": cpu_name(), "dtype": dtype, "pooler": args.pooler, "num_inputs": args.num_inputs,
              "input_len": args.input_len, "batch_size": args.batch_size, "concurrency": args.concurrency,
              "runs": runs, "prompts_per_run": "fresh (seed + run)"}
    for key in ("in_process", "services", "ratio"):
        result[f"{key}_median"] = statistics.median(r[key] for r in runs)
    print(f"embeddings/s (median of {len(runs)}): in-process {result['in_process_median']:.1f}, services "
          f"{result['services_median']:.1f} ({result['ratio_median']:.3f}x); {args.num_inputs} inputs of "
          f"{args.input_len} tokens, {dtype}, pooler {args.pooler}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result

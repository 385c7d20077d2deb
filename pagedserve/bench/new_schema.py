"""`pagedserve bench structured --new-schema-properties P`: what a new grammar costs the streams beside
it. --streams greedy streams decode; at their 20th step a request arrives under a JSON schema of P
required integer properties that no earlier request used (each round its own names: nothing cached),
so the worker compiles it. Reports, per round, the streams' median step before the arrival, the
largest step after it, and the request's time to its first token; and the worker's grammar stalls
(compiles its step thread waited for: 0 when the grammar compiled ahead, while the request waited,
unscheduled: scheduler/core/grammar_wait.py). Step times are the engine's step calls only (the
request's own admission, with its schema check, is not in them)."""

from __future__ import annotations

import json
import statistics
import time

from pagedserve.common.sampling_params import SamplingParams, StructuredOutput

ARRIVAL_STEP = 20


def new_schema(properties: int, salt: str) -> str:
    keys = [f"k{salt}_{i}" for i in range(properties)]
    return json.dumps({"type": "object", "properties": {k: {"type": "integer"} for k in keys}, "required": keys,
                       "additionalProperties": False})


def one_round(engine, rng, streams: int, properties: int, salt: str) -> dict:
    vocab = engine.model_config.vocab_size
    for i in range(streams):
        engine.add_request(f"stream-{salt}-{i}", rng.integers(100, vocab, 64).tolist(),
                           SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=ARRIVAL_STEP + 100))
    rid, arrived, first = f"schema-{salt}", None, None
    before, after = [], []
    while engine.has_unfinished():
        if arrived is None and len(before) == ARRIVAL_STEP:
            schema = StructuredOutput(json_schema=new_schema(properties, salt))
            engine.add_request(rid, rng.integers(100, vocab, 32).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=8, structured_output=schema))
            arrived = time.perf_counter()
        started = time.perf_counter()
        outs = engine.step()
        ended = time.perf_counter()
        (after if arrived is not None else before).append(ended - started)
        if first is None and any(o.request_id == rid and o.new_tokens for o in outs):
            first = ended - arrived
    return {"step_ms_median_before": 1000 * statistics.median(before[5:]), "step_ms_max_after": 1000 * max(after),
            "largest_after_at": after.index(max(after)), "ttft_ms": 1000 * first}


def run_new_schema(engine, args) -> dict:
    import numpy as np
    import torch

    from pagedserve.bench.throughput import cpu_name

    rng = np.random.default_rng(0)
    # Warm-up, untimed: the model and the LLTokenizer (built with the first grammar).
    one_round(engine, rng, args.streams, 8, "warm")
    stalls = engine.runner.grammars.stalls
    rounds = []
    for i in range(args.rounds):
        rounds.append(one_round(engine, rng, args.streams, args.new_schema_properties, f"r{i}"))
        r = rounds[-1]
        print(f"round {i + 1}: step median {r['step_ms_median_before']:.1f} ms before the new schema, largest "
              f"{r['step_ms_max_after']:.1f} ms after it (step {r['largest_after_at']}); its first token after "
              f"{r['ttft_ms']:.0f} ms", flush=True)
    result = {"streams": args.streams, "properties": args.new_schema_properties, "rounds": rounds,
              "grammar_stalls": engine.runner.grammars.stalls - stalls,
              "step_ms_max_after": statistics.median(r["step_ms_max_after"] for r in rounds),
              "step_ms_median_before": statistics.median(r["step_ms_median_before"] for r in rounds),
              "ttft_ms": statistics.median(r["ttft_ms"] for r in rounds),
              "dtype": str(engine.dtype).removeprefix("torch."), "torch_threads": torch.get_num_threads(),
              "cpu": cpu_name()}
    print(f"median of {args.rounds}: step {result['step_ms_median_before']:.1f} ms, largest after the new schema "
          f"{result['step_ms_max_after']:.1f} ms, its first token {result['ttft_ms']:.0f} ms; "
          f"grammar stalls on the step thread: {result['grammar_stalls']}")
    return result

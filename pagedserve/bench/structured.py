"""`pagedserve bench structured`: the cost of a grammar. The throughput bench's workload W<N>
(`pagedserve bench throughput`: same prompts and output lengths, greedy, ignore_eos) run on one
engine as A (no constraint) and B (every other request under a JSON schema), alternating A, B,
A, B, ... so that both see the same machine load; output tokens are equal in A and B by
construction (ignore_eos: a sample whose JSON is complete goes on with eos, the only token its
grammar then allows). Reports output tokens/s of each, the ratio B/A, and the worker's grammar
mask time (filling the bitmasks and unpacking them, per step that had a constrained row).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pagedserve.common.engine_args import add_engine_args
from pagedserve.common.sampling_params import SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "items"],
          "properties": {"title": {"type": "string"},
                         "items": {"type": "array", "items": {
                             "type": "object", "additionalProperties": False, "required": ["name", "qty", "kind"],
                             "properties": {"name": {"type": "string"}, "qty": {"type": "integer"},
                                            "kind": {"enum": ["fruit", "tool", "book"]}}}}}}


def add_structured_parser(bench_sub) -> None:
    p = bench_sub.add_parser("structured", help="throughput with half the requests under a JSON schema vs none",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="A/B pairs, alternating (default 3)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON here")
    p.add_argument("--new-schema-properties", type=int, default=0, metavar="P",
                   help="instead: a new JSON schema of P properties arrives while --streams streams decode; the "
                        "largest step after it, and its first token (bench/new_schema.py)")
    p.add_argument("--streams", type=int, default=8, help="with --new-schema-properties (default 8)")
    add_engine_args(p)
    p.set_defaults(func=run_structured)


def _run(engine, work, constrained: bool) -> dict:
    from pagedserve.bench.throughput import run_engine

    grammars, sampler = engine.runner.grammars, engine.runner.sampler
    mask_s, mask_steps = grammars.mask_time_s + sampler.mask_time_s, grammars.mask_steps
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o,
                             structured_output=spec if constrained and i % 2 == 0 else None)
              for i, o in enumerate(work.output_lens)]
    out = run_engine(engine, work, params)
    steps = grammars.mask_steps - mask_steps
    mask_s = grammars.mask_time_s + sampler.mask_time_s - mask_s
    return {"output_tokens_per_s": work.num_output_tokens / out["elapsed_s"], "elapsed_s": out["elapsed_s"],
            "num_steps": out["num_steps"], "mask_steps": steps, "mask_time_s": mask_s,
            "mask_ms_per_step": 1000 * mask_s / steps if steps else 0.0,
            "step_ms_median": 1000 * statistics.median(out["step_times"])}


def run_structured(args) -> dict:
    import torch

    from pagedserve.bench.throughput import build_engine, cpu_name, load_tokenizer, make_workload
    from pagedserve.model_files.default_model import resolve_model

    torch.manual_seed(0)
    args.no_prefix_caching = True  # every run prefills its prompts: rounds after the first would hit the cache
    model_path = resolve_model(args.model, args.revision)
    engine = build_engine(args, model_path, load_tokenizer(model_path))
    if args.new_schema_properties:
        from pagedserve.bench.new_schema import run_new_schema
        result = run_new_schema(engine, args)
        engine.close()
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return result
    work = make_workload(args.num_prompts, engine.model_config.vocab_size)
    # Warm-up, untimed: the model, and the LLTokenizer and the schema's compiled grammar.
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    engine.generate([[100 + i for i in range(8)]],
                    SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4, structured_output=spec))
    runs: dict[str, list[dict]] = {"plain": [], "schema": []}
    for round_ in range(args.rounds):
        for name in ("plain", "schema"):
            runs[name].append(_run(engine, work, name == "schema"))
            r = runs[name][-1]
            print(f"round {round_ + 1} {name:>6}: {r['output_tokens_per_s']:.1f} output tok/s, "
                  f"step median {r['step_ms_median']:.1f} ms, mask {r['mask_ms_per_step']:.2f} ms/step "
                  f"over {r['mask_steps']} steps", flush=True)
    engine.close()
    plain = statistics.median(r["output_tokens_per_s"] for r in runs["plain"])
    schema = statistics.median(r["output_tokens_per_s"] for r in runs["schema"])
    result = {"num_requests": len(work.prompts), "num_constrained": (len(work.prompts) + 1) // 2,
              "num_output_tokens": work.num_output_tokens, "rounds": args.rounds,
              "plain_output_tokens_per_s": plain, "schema_output_tokens_per_s": schema, "ratio": schema / plain,
              "mask_ms_per_step": statistics.median(r["mask_ms_per_step"] for r in runs["schema"]),
              "step_ms_median_plain": statistics.median(r["step_ms_median"] for r in runs["plain"]),
              "step_ms_median_schema": statistics.median(r["step_ms_median"] for r in runs["schema"]),
              "dtype": str(engine.dtype).removeprefix("torch."), "model": str(model_path),
              "torch_threads": torch.get_num_threads(), "cpu": cpu_name(), "runs": runs}
    print(f"output tok/s (median of {args.rounds}): plain {plain:.1f}, half under a JSON schema {schema:.1f} "
          f"(ratio {schema / plain:.3f}); grammar masks {result['mask_ms_per_step']:.2f} ms per step "
          f"(step median {result['step_ms_median_schema']:.1f} ms vs {result['step_ms_median_plain']:.1f} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result

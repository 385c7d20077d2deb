"""W<N> through vLLM's offline `LLM.generate`: run by `pagedserve bench vllm-cpu` with the Python of
a separate virtual environment holding vLLM (so this file imports only vllm, numpy and the standard
library, never pagedserve).

    python vllm_runner.py MODEL_DIR --out FILE --dtype bfloat16 --num-prompts 64 [--enforce-eager]

writes one JSON object to FILE (vLLM prints on stdout too): output_tokens_per_s, elapsed_s and the
token counts. The workload is bench/throughput.py's make_workload, restated here
(tests/test_bench_vllm.py holds the two equal).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def make_workload(num_prompts: int, vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    plens = rng.integers(16, 257, num_prompts)
    olens = rng.integers(16, 129, num_prompts)
    prompts = [rng.integers(100, vocab_size, int(plen)).tolist() for plen in plens]
    return prompts, [int(o) for o in olens]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args(argv)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              enforce_eager=args.enforce_eager, seed=0)
    prompts, olens = make_workload(args.num_prompts, args.vocab_size)
    # Warm-up outside the timed region, as `pagedserve bench throughput` does.
    llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 108)))],
                 SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for o in olens]
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    with open(args.out, "w") as f:
        json.dump({"output_tokens_per_s": num_out / elapsed, "elapsed_s": elapsed, "num_output_tokens": num_out,
                   "num_prompt_tokens": sum(len(p) for p in prompts), "num_requests": len(prompts),
                   "first_output_token_ids": list(outs[0].outputs[0].token_ids[:16])}, f)


if __name__ == "__main__":
    main()

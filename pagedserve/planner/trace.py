"""The planner's workload: a list of requests, each with its prompt's token ids, its output length
and its send time; from `bench serve`'s own datasets and arrival process, or from a trace file.

Trace files are JSON lines, one request each:
    {"arrival_s": 0.12, "prompt_tokens": 128, "output_tokens": 64}
optionally with "prefix_id" and "prefix_tokens" (requests of one prefix_id share their first
prefix_tokens tokens, so the prefix cache sees what it would), or "prompt_token_ids" (the exact
prompt; `bench serve --record-trace` writes these), and "lora" (the name of the request's LoRA
adapter). arrival_s is the time the client sends it, from the start of the run; lines need not be
sorted. `plan --loras N` spreads a dataset's requests round robin over N adapters instead.

Synthetic prompts are token ids (the block manager hashes ids, so only equality matters): the
random and prefix datasets draw them exactly as `bench serve` does with a tokenizer, so with the same
--seed the planner sees the same lengths and the same sharing as the real run. No torch here.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedserve.bench.serve_client import arrival_gaps
from pagedserve.bench.serve_datasets import PromptMaker, load_sharegpt, prefix_requests, random_requests

SYNTHETIC_VOCAB = 32000  # ids of synthetic prompts: any range works, equal ids are all that matter


@dataclass(slots=True)
class TraceRequest:
    arrival_s: float  # when the client sends it (a concurrency cap may hold it back further)
    prompt_token_ids: list[int]
    output_tokens: int
    lora: str | None = None  # the request's LoRA adapter (its name), if any

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def _id_maker(tokenizer=None) -> PromptMaker:
    maker = PromptMaker(tokenizer)
    if maker.ids is None:
        maker.ids = np.arange(100, SYNTHETIC_VOCAB)
    return maker


def _ids(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if tokenizer is not None:
        return tokenizer(prompt, add_special_tokens=False).input_ids
    # No tokenizer: ShareGPT lengths are estimates (words x 1.3); ids stand in for them.
    n = max(1, round(len(prompt.split()) * 1.3))
    seed = zlib.crc32(prompt.encode())  # str hash() is salted per process: not reproducible
    return [100 + (seed + i) % (SYNTHETIC_VOCAB - 100) for i in range(n)]


def from_dataset(args, tokenizer=None) -> list[TraceRequest]:
    """`bench serve`'s dataset for these flags (same seed, same draws), with its arrival times."""
    maker = _id_maker(tokenizer)
    if args.dataset == "random":
        requests = random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
                                   maker)
    elif args.dataset == "prefix":
        requests = prefix_requests(args.num_prefixes, args.suffixes_per_prefix, args.prefix_len, args.suffix_len,
                                   args.output_len, args.seed, maker)
    else:
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE")
        requests = load_sharegpt(args.dataset_path, args.num_prompts, args.seed, tokenizer)
    gaps = arrival_gaps(len(requests), args.request_rate, args.seed, args.burstiness)
    arrivals = np.cumsum(gaps).tolist() if gaps else []
    return [TraceRequest(t, _ids(q.prompt, tokenizer), q.output_len) for t, q in zip(arrivals, requests)]


def load_trace(path: str | Path) -> list[TraceRequest]:
    prefixes: dict[str, list[int]] = {}
    rng = np.random.default_rng(0)
    out = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
            arrival = float(item["arrival_s"])
            output = int(item["output_tokens"])
            if "prompt_token_ids" in item:
                ids = [int(t) for t in item["prompt_token_ids"]]
            else:
                length = int(item["prompt_tokens"])
                shared = min(length, int(item.get("prefix_tokens", 0)))
                ids = []
                if item.get("prefix_id") is not None and shared:
                    key = str(item["prefix_id"])
                    prefix = prefixes.setdefault(key, rng.integers(100, SYNTHETIC_VOCAB, shared).tolist())
                    if len(prefix) < shared:
                        raise ValueError(f"prefix_id {key} was {len(prefix)} tokens before, {shared} here")
                    ids = prefix[:shared]
                ids = ids + rng.integers(100, SYNTHETIC_VOCAB, length - len(ids)).tolist()
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"{where}: a trace line needs arrival_s, output_tokens and prompt_tokens or "
                             f"prompt_token_ids ({exc})") from None
        if not ids or output < 1 or not math.isfinite(arrival) or arrival < 0:
            raise ValueError(f"{where}: needs >= 1 prompt token, >= 1 output token and arrival_s >= 0")
        lora = item.get("lora")
        out.append(TraceRequest(arrival, ids, output, str(lora) if lora else None))
    if not out:
        raise ValueError(f"{path}: the trace holds no request")
    out.sort(key=lambda r: r.arrival_s)
    return out


def spread_over_adapters(requests: list[TraceRequest], count: int) -> list[TraceRequest]:
    """`plan --loras N`: request i runs with adapter lora-(i mod N), as `bench throughput --loras`
    spreads its requests (count 0: as they are)."""
    for i, r in enumerate(requests if count > 0 else []):
        r.lora = f"lora-{i % count}"
    return requests


def write_trace(path: str | Path, requests: list[TraceRequest]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps({"arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                                "output_tokens": r.output_tokens, "prompt_token_ids": r.prompt_token_ids,
                                **({"lora": r.lora} if r.lora else {})}) + "\n")

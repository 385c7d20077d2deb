"""`pagedserve bench serve`: a load generator against any OpenAI-compatible endpoint (ours or
another server's), in the manner of vLLM's serving benchmark.

Every request streams (SSE) with temperature 0, max_tokens = its output length, ignore_eos and
stream_options.include_usage; it also asks for `"timings": true`, which our gateway answers with a
`timings` object in the final chunk (the server's TTFT and its breakdown by stage). Load is either
Poisson arrivals at --request-rate (seeded; inf sends everything at once) or a closed loop of
--max-concurrency clients, or both. Per request: TTFT (send -> first content chunk), ITL (gaps
between content chunks), TPOT ((e2e - ttft) / (output tokens - 1)), end-to-end latency, output
tokens (the server's usage when given, else the chunk count), and failures (HTTP errors, errors in
the stream and exceptions are counted, never raised).

Datasets:
  random    prompts of --input-len tokens, outputs of --output-len, both uniform in
            [len*(1-r), len*(1+r)] for --range-ratio r. With a tokenizer (--tokenizer, or the
            model id when it is a local folder or one pagedserve prepared) the prompt is a list
            of random token ids (exact length on /v1/completions); without one it is text of
            random common words. Input
            lengths reported are the server's usage.prompt_tokens whenever it gives them.
  prefix    --num-prefixes shared prefixes of --prefix-len x --suffixes-per-prefix suffixes of
            --suffix-len, shuffled: exercises prefix caching.
  sharegpt  --dataset-path FILE, a JSON list or JSONL of {"conversations": [{"from": "human",
            "value": ...}, {"from": "gpt", ...}]}: the first human turn is the prompt and the reply
            after it sets max_tokens (its token count with a tokenizer, else words x 1.3).

--sweep rates:1,2,4,inf or --sweep concurrency:1,4,16 runs the dataset at each load level (level i
draws its prompts with seed + i: the same distribution, fresh prompts, so no level gets the previous
one's prefix-cache hits) and
writes <out-dir>/sweep.json and PNG plots (throughput, TTFT and TPOT percentiles vs load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TTFT_STAGES = ("gateway", "tokenizer", "queue", "prefill", "network")
PERCENTILES = (("median", 50), ("p90", 90), ("p99", 99))
# ShareGPT filtering, as vLLM's benchmark does it.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048
# Text prompts when no tokenizer is known: common English words, about one token each.
WORDS = ("the of and to in is was for on are with as at be by this have from or one had not but what all were "
         "when we there can an your which their said if will each about how up out them then she many some so "
         "these would other into has more her two like him see time could no make than first been its who now "
         "people my made over did down only way find use may water long little very after words called just "
         "where most know get through back much before go good new write our used me man too any day same right "
         "look think also around another came come work three word must because does part even place well such "
         "here take why things help put years different away again off went old number great tell men say small "
         "every found still between name should home big give air line set own under read last never us left end "
         "along while might next sound below saw something thought both few those always looked show large often "
         "together asked house world going want school important until form food keep children feet land side "
         "without boy once animals life enough took sometimes four head above kind began almost live page got "
         "earth need far hand high year mother light parts country father let night following picture being study "
         "second eyes soon times story boys since white days ever paper hard near sentence better best across "
         "during today others however sure means knew try told young miles sun ways thing whole hear example "
         "heard several change answer room sea against top turned learn point city play toward five using himself "
         "usually").split()


# ---- CLI ----------------------------------------------------------------------------------------

def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"the request rate must be positive or inf, got {text!r}")
    return rate


def parse_sweep(text: str) -> tuple[str, list[float]]:
    kind, _, values = text.partition(":")
    kind = {"rate": "rates", "rates": "rates", "concurrency": "concurrency"}.get(kind.strip())
    if kind is None or not values.strip():
        raise argparse.ArgumentTypeError(f"--sweep takes rates:1,2,inf or concurrency:1,4,16, got {text!r}")
    try:
        levels = [float(v) for v in values.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--sweep: {e}") from None
    if not levels or any(not v > 0 for v in levels):
        raise argparse.ArgumentTypeError(f"--sweep levels must be positive, got {values!r}")
    if kind == "concurrency" and any(math.isinf(v) or v != int(v) for v in levels):
        raise argparse.ArgumentTypeError(f"--sweep concurrency levels must be integers, got {values!r}")
    return kind, levels


def add_serve_parser(bench_sub) -> None:
    p = bench_sub.add_parser("serve", help="load generator against an OpenAI-compatible endpoint (vLLM style)",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer (path or name) for token-id prompts and ShareGPT lengths; default: the "
                        "model id when it is a local folder or a model pagedserve prepared, else none "
                        "(text prompts)")
    p.add_argument("--dataset", choices=["random", "prefix", "sharegpt"], default="random")
    p.add_argument("--dataset-path", default=None, help="the ShareGPT JSON/JSONL file")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="random dataset")
    p.add_argument("--output-len", type=int, default=128, help="random and prefix datasets")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random lengths uniform in len*(1 -/+ r)")
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix dataset")
    p.add_argument("--suffixes-per-prefix", type=int, default=8, help="prefix dataset")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix dataset")
    p.add_argument("--suffix-len", type=int, default=32, help="prefix dataset")
    p.add_argument("--request-rate", type=parse_rate, default=math.inf,
                   help="Poisson arrivals per second (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times (1 = Poisson; <1 burstier, >1 more regular)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT at most this")
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent (unmeasured) before the run")
    p.add_argument("--plain-openai", action="store_true",
                   help="leave out the fields only vLLM-like servers know (ignore_eos, timings)")
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout, seconds")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--sweep", type=parse_sweep, nargs="?", default=None, const=("concurrency", [1.0, 4.0, 16.0, 64.0]),
                   metavar="rates:1,2,inf|concurrency:1,4,16",
                   help="run at each load level and plot; alone: concurrency:1,4,16,64")
    p.add_argument("--out-dir", default="bench-serve-out", help="where --sweep writes sweep.json and the plots")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON here")
    p.set_defaults(func=run_serve_bench)


# ---- arrivals and statistics --------------------------------------------------------------------

def arrival_gaps(num: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds to wait before each request: gamma(burstiness) gaps with mean 1/rate (exponential,
    i.e. Poisson arrivals, at burstiness 1); all zero at rate inf."""
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), num).tolist()


def summarize(values: list[float]) -> dict:
    """mean, median, p90, p99 (numpy's linear interpolation); None each when there is nothing."""
    if not values:
        return {"mean": None, **{name: None for name, _ in PERCENTILES}}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), **{name: float(np.percentile(arr, q)) for name, q in PERCENTILES}}


# ---- datasets -----------------------------------------------------------------------------------

@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int  # as generated or estimated; the server's usage replaces it when given
    output_len: int


class PromptMaker:
    """Random prompts of a given length: token ids of the tokenizer's vocabulary when there is one
    (special tokens left out), else random common words."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self.ids: np.ndarray | None = None
        if tokenizer is not None:
            vocab = int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer))
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
            self.ids = np.asarray([i for i in range(min(100, vocab // 2), vocab) if i not in special])

    @property
    def kind(self) -> str:
        return "token_ids" if self.ids is not None else "text"

    def make(self, rng: np.random.Generator, length: int) -> str | list[int]:
        if self.ids is not None:
            return self.ids[rng.integers(0, len(self.ids), length)].tolist()
        return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), length))

    @staticmethod
    def join(prefix: str | list[int], suffix: str | list[int]) -> str | list[int]:
        return prefix + suffix if isinstance(prefix, list) else f"{prefix} {suffix}"


def _lengths(rng: np.random.Generator, num: int, length: int, ratio: float) -> list[int]:
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.integers(low, high + 1, num).tolist()


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    maker: PromptMaker) -> list[BenchRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, num, input_len, range_ratio)
    out_lens = _lengths(rng, num, output_len, range_ratio)
    return [BenchRequest(maker.make(rng, n), n, o) for n, o in zip(in_lens, out_lens)]


def prefix_requests(num_prefixes: int, suffixes_per_prefix: int, prefix_len: int, suffix_len: int,
                    output_len: int, seed: int, maker: PromptMaker) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_prefixes):
        prefix = maker.make(rng, prefix_len)
        for _ in range(suffixes_per_prefix):
            out.append(BenchRequest(maker.join(prefix, maker.make(rng, suffix_len)), prefix_len + suffix_len,
                                    output_len))
    random.Random(seed).shuffle(out)
    return out


def _count_tokens(text: str, tokenizer) -> int:
    if tokenizer is not None:
        return len(tokenizer(text, add_special_tokens=False).input_ids)
    return round(len(text.split()) * 1.3)


def load_sharegpt(path: str | Path, num: int, seed: int, tokenizer=None) -> list[BenchRequest]:
    """The first human turn of each conversation with the reply after it; shuffled (seeded), too
    short (< 4 tokens) or too long (prompt > 1024, prompt + reply > 2048) ones skipped."""
    text = Path(path).read_text()
    stripped = text.lstrip()
    if stripped.startswith("["):
        entries = json.loads(text)
    else:
        entries = [json.loads(line) for line in text.splitlines() if line.strip()]
    random.Random(seed).shuffle(entries)
    out = []
    for entry in entries:
        turns = entry.get("conversations") or entry.get("conversation") or []
        human = next((i for i, t in enumerate(turns) if t.get("from") in ("human", "user")), None)
        if human is None:
            continue
        reply = next((t for t in turns[human + 1:] if t.get("from") in ("gpt", "assistant", "chatgpt")), None)
        if reply is None:
            continue
        prompt = turns[human].get("value") or ""
        prompt_len, output_len = _count_tokens(prompt, tokenizer), _count_tokens(reply.get("value") or "", tokenizer)
        if prompt_len < SHAREGPT_MIN_LEN or output_len < SHAREGPT_MIN_LEN:
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT or prompt_len + output_len > SHAREGPT_MAX_TOTAL:
            continue
        out.append(BenchRequest(prompt, prompt_len, output_len))
        if len(out) == num:
            break
    return out


def build_dataset(args, tokenizer) -> tuple[list[BenchRequest], str]:
    maker = PromptMaker(tokenizer)
    if args.dataset == "random":
        return random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
                               maker), maker.kind
    if args.dataset == "prefix":
        return prefix_requests(args.num_prefixes, args.suffixes_per_prefix, args.prefix_len, args.suffix_len,
                               args.output_len, args.seed, maker), maker.kind
    if not args.dataset_path:
        raise SystemExit("--dataset sharegpt needs --dataset-path FILE")
    requests = load_sharegpt(args.dataset_path, args.num_prompts, args.seed, tokenizer)
    if not requests:
        raise SystemExit(f"no usable conversation in {args.dataset_path}")
    return requests, "text"


def _local_model_folder(model: str | None) -> str | None:
    """The model id as a local folder, or as a model pagedserve has prepared (its id is the folder's name)."""
    if not model:
        return None
    if Path(model).is_dir():
        return model
    from pagedserve.model_files.default_model import data_dir

    prepared = data_dir() / "models" / Path(model).name
    return str(prepared) if (prepared / "tokenizer.json").is_file() else None


def load_tokenizer(name: str | None, model: str | None):
    """--tokenizer, else the model id when it names a local folder (or one pagedserve prepared); None
    when neither loads."""
    candidate = name or _local_model_folder(model)
    if candidate is None:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(candidate)
    except Exception as e:  # noqa: BLE001 - text prompts work without one
        if name:
            raise SystemExit(f"cannot load the tokenizer {name!r}: {e}") from None
        return None


# ---- one request --------------------------------------------------------------------------------

@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None  # the server's usage
    timings: dict | None = None

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def request_body(req: BenchRequest, model: str, endpoint: str, plain: bool, tokenizer=None) -> dict:
    body: dict = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if not plain:
        body.update(ignore_eos=True, timings=True)
    if endpoint == "chat":
        prompt = req.prompt
        if isinstance(prompt, list):
            prompt = tokenizer.decode(prompt) if tokenizer is not None else " ".join(map(str, prompt))
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_text(choice: dict) -> str:
    if "delta" in choice:
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send_request(http, url: str, body: dict, headers: dict) -> RequestResult:
    """One streamed request, timed from the send to its last chunk. Never raises."""
    result = RequestResult()
    start = time.perf_counter()
    content_times: list[float] = []
    choice_times: list[float] = []
    chunks_usage = None
    try:
        async with http.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:500]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = f"error in the stream: {json.dumps(chunk['error'])[:500]}"
                    return result
                if choices := chunk.get("choices"):
                    choice_times.append(now)
                    if _chunk_text(choices[0]):
                        content_times.append(now)
                if usage := chunk.get("usage"):
                    chunks_usage = usage
                if isinstance(chunk.get("timings"), dict):
                    result.timings = chunk["timings"]
        end = time.perf_counter()
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        result.error = f"{type(e).__name__}: {e}"
        return result
    times = content_times or choice_times  # a server that streams no text still streams chunks
    if not times:
        result.error = "the stream carried no token"
        return result
    result.success = True
    result.ttft = times[0] - start
    result.itl = [b - a for a, b in zip(times, times[1:])]
    result.latency = end - start
    result.output_tokens = len(times)
    if chunks_usage:
        result.output_tokens = int(chunks_usage.get("completion_tokens") or result.output_tokens)
        if chunks_usage.get("prompt_tokens") is not None:
            result.prompt_tokens = int(chunks_usage["prompt_tokens"])
    return result


# ---- the server's metrics -----------------------------------------------------------------------

def read_prefix_cache_counters(http_sync, base_url: str, headers: dict) -> tuple[float, float] | None:
    """(hits, queries) of our gateway's Prometheus counters, or None if the endpoint lacks them."""
    try:
        reply = http_sync.get(base_url + "/metrics", headers=headers)
        if reply.status_code != 200:
            return None
    except Exception:  # noqa: BLE001
        return None
    values = {}
    for line in reply.text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, rest = line.partition(" ")
        name = name.split("{", 1)[0].removesuffix("_total")
        if name in ("pagedserve:prefix_cache_hits", "pagedserve:prefix_cache_queries"):
            try:
                values[name] = float(rest.split()[0])
            except (ValueError, IndexError):
                pass
    if len(values) != 2:
        return None
    return values["pagedserve:prefix_cache_hits"], values["pagedserve:prefix_cache_queries"]


def resolve_model(http_sync, base_url: str, headers: dict) -> str:
    reply = http_sync.get(base_url + "/v1/models", headers=headers)
    if reply.status_code != 200:
        raise SystemExit(f"GET {base_url}/v1/models: HTTP {reply.status_code}: {reply.text[:300]}")
    data = reply.json().get("data") or []
    if not data:
        raise SystemExit(f"GET {base_url}/v1/models lists no model: pass --model")
    return data[0]["id"]


# ---- a run --------------------------------------------------------------------------------------

async def run_requests(base_url: str, endpoint: str, bodies: list[dict], headers: dict, request_rate: float,
                       max_concurrency: int | None, seed: int, burstiness: float, timeout: float,
                       progress: bool) -> tuple[list[RequestResult], float]:
    import httpx
    from tqdm import tqdm

    url = base_url + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    gaps = arrival_gaps(len(bodies), request_rate, seed, burstiness)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connections = max_concurrency or max(1, len(bodies))
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    bar = tqdm(total=len(bodies), disable=not progress, desc="requests", unit="req")

    async def one(http, body: dict) -> RequestResult:
        if gate is None:
            result = await send_request(http, url, body, headers)
        else:
            async with gate:
                result = await send_request(http, url, body, headers)
        bar.update(1)
        return result

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        tasks = []
        for gap, body in zip(gaps, bodies):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(http, body)))
        results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def aggregate(results: list[RequestResult], requests: list[BenchRequest], duration: float,
              slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict:
    ok = [(r, q) for r, q in zip(results, requests) if r.success]
    ms = 1e3
    output_tokens = sum(r.output_tokens for r, _ in ok)
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else q.prompt_len for r, q in ok)
    ttfts = [r.ttft * ms for r, _ in ok]
    tpots = [r.tpot * ms for r, _ in ok if r.tpot is not None]
    itls = [g * ms for r, _ in ok for g in r.itl]
    e2els = [r.latency * ms for r, _ in ok]
    goodput = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(1 for r, _ in ok
                   if (slo_ttft_ms is None or r.ttft * ms <= slo_ttft_ms)
                   and (slo_tpot_ms is None or (r.tpot or 0.0) * ms <= slo_tpot_ms))
        goodput = good / duration if duration > 0 else None
    # "Where did my first token go": the server's stages, and the client's share beyond them.
    stages: dict[str, list[float]] = {}
    overheads = []
    for r, _ in ok:
        t = r.timings or {}
        for stage, value in (t.get("ttft_breakdown_ms") or {}).items():
            if isinstance(value, (int, float)):
                stages.setdefault(stage, []).append(float(value))
        if isinstance(t.get("ttft_ms"), (int, float)):
            overheads.append(r.ttft * ms - float(t["ttft_ms"]))
    breakdown = {stage: float(np.mean(v)) for stage, v in stages.items()}
    if overheads:
        breakdown["client_overhead"] = float(np.mean(overheads))
    errors = [r.error for r in results if not r.success]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
        "goodput": goodput,
        "ttft_ms": summarize(ttfts), "tpot_ms": summarize(tpots), "itl_ms": summarize(itls),
        "e2el_ms": summarize(e2els), "ttft_breakdown_ms": breakdown,
        "server_ttft_ms": summarize([float(r.timings["ttft_ms"]) for r, _ in ok
                                     if r.timings and isinstance(r.timings.get("ttft_ms"), (int, float))]),
        "errors": errors[:20],
        "requests": [{"prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens if r.success else None,
                      "expected_output_tokens": q.output_len, "ttft_ms": r.ttft * ms if r.success else None,
                      "e2el_ms": r.latency * ms if r.success else None, "error": r.error or None}
                     for r, q in zip(results, requests)],
    }


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def print_report(result: dict) -> None:
    line = "=" * 60
    rows = [("Successful requests:", result["completed"]), ("Failed requests:", result["failed"]),
            ("Request rate (configured):", result["request_rate"]),
            ("Max concurrency:", result["max_concurrency"]),
            ("Benchmark duration (s):", _fmt(result["duration_s"])),
            ("Total input tokens:", result["total_input_tokens"]),
            ("Total generated tokens:", result["total_output_tokens"]),
            ("Request throughput (req/s):", _fmt(result["request_throughput"])),
            ("Output token throughput (tok/s):", _fmt(result["output_throughput"])),
            ("Total token throughput (tok/s):", _fmt(result["total_token_throughput"]))]
    if result["goodput"] is not None:
        rows.append(("Request goodput (req/s):", _fmt(result["goodput"])))
    if result["prefix_cache_hit_rate"] is not None:
        rows.append(("Prefix cache hit rate:", f"{100 * result['prefix_cache_hit_rate']:.1f}%"))
    print(f"{' Serving Benchmark Result ':=^60}")
    for label, value in rows:
        print(f"{label:<40}{value!s:>20}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        short = key.removesuffix("_ms").upper()
        print(f"{' ' + title + ' ':-^60}")
        s = result[key]
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            print(f"{f'{label} {short} (ms):':<40}{_fmt(s[stat]):>20}")
    breakdown = result["ttft_breakdown_ms"]
    if breakdown:
        print(f"{' Where did my first token go (mean ms) ':-^60}")
        total = result["ttft_ms"]["mean"] or 0.0
        for stage, value in breakdown.items():
            share = f"{100 * value / total:5.1f}%" if total else ""
            print(f"{stage:<40}{value:>12.2f}{share:>8}")
        print(f"{'client TTFT (mean)':<40}{total:>12.2f}")
    for error in result["errors"][:3]:
        print(f"failed: {error}")
    print(line)


def run_once(args, model: str, requests: list[BenchRequest], tokenizer, request_rate: float,
             max_concurrency: int | None, progress: bool) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    bodies = [request_body(q, model, args.endpoint, args.plain_openai, tokenizer) for q in requests]
    with httpx.Client(timeout=30) as http_sync:
        before = read_prefix_cache_counters(http_sync, args.base_url, headers)
        results, duration = asyncio.run(run_requests(
            args.base_url, args.endpoint, bodies, headers, request_rate, max_concurrency, args.seed,
            args.burstiness, args.timeout, progress))
        after = read_prefix_cache_counters(http_sync, args.base_url, headers)
    result = aggregate(results, requests, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    hit_rate = None
    if before is not None and after is not None and after[1] > before[1]:
        hit_rate = (after[0] - before[0]) / (after[1] - before[1])
    result["prefix_cache_hit_rate"] = hit_rate
    result.update(request_rate="inf" if math.isinf(request_rate) else request_rate,
                  max_concurrency=max_concurrency)
    return result


def run_serve_bench(args) -> dict:
    import httpx

    args.base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        with httpx.Client(timeout=30) as http_sync:
            model = resolve_model(http_sync, args.base_url, headers)
    tokenizer = load_tokenizer(args.tokenizer, model)
    requests, prompt_format = build_dataset(args, tokenizer)
    config = {"base_url": args.base_url, "model": model, "endpoint": args.endpoint, "dataset": args.dataset,
              "dataset_path": args.dataset_path, "num_prompts": len(requests), "prompt_format": prompt_format,
              "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
              "num_prefixes": args.num_prefixes, "suffixes_per_prefix": args.suffixes_per_prefix,
              "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "burstiness": args.burstiness,
              "seed": args.seed, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms}
    if args.num_warmups > 0:
        warm = requests[:args.num_warmups]
        run_once(args, model, warm, tokenizer, math.inf, args.max_concurrency, progress=False)
    if args.sweep is None:
        result = {**run_once(args, model, requests, tokenizer, args.request_rate, args.max_concurrency,
                             progress=not args.disable_tqdm), **config}
        print_report(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return result

    kind, levels = args.sweep
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    per_level = []
    base_seed = args.seed
    for index, level in enumerate(levels):
        rate = level if kind == "rates" else args.request_rate
        concurrency = int(level) if kind == "concurrency" else args.max_concurrency
        if index:
            # Fresh prompts of the same distribution at each level: repeating the previous level's
            # prompts would turn every prefill into a prefix-cache hit and flatter the later levels.
            args.seed = base_seed + index
            requests, _ = build_dataset(args, tokenizer)
        print(f"--- {kind} {_level_label(level)}", flush=True)
        result = {**run_once(args, model, requests, tokenizer, rate, concurrency, progress=not args.disable_tqdm),
                  **config, "seed": args.seed, "sweep_kind": kind, "sweep_level": _level_label(level)}
        print_report(result)
        per_level.append(result)
    (out_dir / "sweep.json").write_text(json.dumps(per_level, indent=2))
    plots = plot_sweep(per_level, kind, out_dir)
    summary = {"sweep_kind": kind, "levels": [_level_label(v) for v in levels], "results": per_level,
               "out_dir": str(out_dir), "plots": [str(p) for p in plots], **config}
    print(f"wrote {out_dir / 'sweep.json'} and {', '.join(p.name for p in plots)}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return summary


def _level_label(level: float) -> str:
    return "inf" if math.isinf(level) else (str(int(level)) if level == int(level) else str(level))


# ---- plots --------------------------------------------------------------------------------------

def plot_sweep(results: list[dict], kind: str, out_dir: Path) -> list[Path]:
    """throughput.png, ttft.png and tpot.png against the load levels (evenly spaced: inf is one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["sweep_level"] for r in results]
    xs = list(range(len(results)))
    xlabel = "request rate (req/s)" if kind == "rates" else "max concurrency"
    paths = []

    def finish(fig, ax, title: str, ylabel: str, name: str) -> None:
        ax.set_xticks(xs, labels)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot(xs, [r["request_throughput"] for r in results], "o-", label="completed requests/s")
    for ax in (left, right):
        ax.set_xticks(xs, labels)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
    left.set_ylabel("requests/s")
    left.set_title("Request throughput vs load")
    left.legend()
    right.plot(xs, [r["output_throughput"] for r in results], "o-", color="tab:green", label="output tokens/s")
    right.plot(xs, [r["total_token_throughput"] for r in results], "s--", color="tab:gray",
               label="total (input + output) tokens/s")
    finish(fig, right, "Token throughput vs load", "tokens/s", "throughput.png")

    for key, title, name in (("ttft_ms", "TTFT vs load", "ttft.png"), ("tpot_ms", "TPOT vs load", "tpot.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for stat, marker in (("median", "o-"), ("p90", "s-"), ("p99", "^-")):
            ys = [r[key][stat] if r[key][stat] is not None else float("nan") for r in results]
            ax.plot(xs, ys, marker, label=stat if stat != "median" else "p50")
        finish(fig, ax, title, key.replace("_ms", " (ms)").upper().replace("(MS)", "(ms)"), name)
    return paths

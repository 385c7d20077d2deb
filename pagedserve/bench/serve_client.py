"""The client side of `pagedserve bench serve`: the arrival schedule, one streamed request (SSE)
timed chunk by chunk, the load of a run (Poisson arrivals and/or a concurrency cap), the server's
prefix-cache counters and model id, and the aggregation of the results into the report's figures."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np

from pagedserve.bench.serve_datasets import BenchRequest

TTFT_STAGES = ("gateway", "tokenizer", "queue", "prefill", "network")
PERCENTILES = (("median", 50), ("p90", 90), ("p99", 99))


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

def read_prefix_cache_counters(http_sync, base_url: str, headers: dict) -> dict[str, tuple[float, float]] | None:
    """replica -> (hits, queries) of our gateway's Prometheus counters ("" for a single engine,
    whose samples carry no `replica` label), or None if the endpoint lacks them."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        reply = http_sync.get(base_url + "/metrics", headers=headers)
        if reply.status_code != 200:
            return None
        families = list(text_string_to_metric_families(reply.text))
    except Exception:  # noqa: BLE001 - not our server, or not Prometheus text
        return None
    values: dict[str, dict[str, float]] = {}
    for family in families:
        if family.name not in ("pagedserve:prefix_cache_hits", "pagedserve:prefix_cache_queries"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            values.setdefault(sample.labels.get("replica", ""), {})[family.name] = float(sample.value)
    out = {replica: (v["pagedserve:prefix_cache_hits"], v["pagedserve:prefix_cache_queries"])
           for replica, v in values.items() if len(v) == 2}
    return out or None


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def read_spec_counters(http_sync, base_url: str, headers: dict) -> dict[str, float] | None:
    """Speculative decoding's counters (pagedserve:spec_decode_*, summed over replicas), or None
    when the server exposes none (speculation off, or not our server)."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        reply = http_sync.get(base_url + "/metrics", headers=headers)
        families = list(text_string_to_metric_families(reply.text)) if reply.status_code == 200 else []
    except Exception:  # noqa: BLE001 - not our server, or not Prometheus text
        return None
    out: dict[str, float] = {}
    for family in families:
        name = family.name.removeprefix("pagedserve:spec_decode_")
        if family.name.startswith("pagedserve:") and name in SPEC_COUNTERS:
            out[name] = sum(s.value for s in family.samples if not s.name.endswith("_created"))
    return out if len(out) == len(SPEC_COUNTERS) else None


def spec_rates(before: dict | None, after: dict | None) -> dict | None:
    """The run's speculative decoding: its counters (after - before), acceptance rate (accepted /
    proposed tokens) and mean acceptance length (1 + accepted / drafts)."""
    if before is None or after is None:
        return None
    d = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0
    d["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 0.0
    return d


def prefix_hit_rates(before: dict | None, after: dict | None) -> tuple[float | None, dict[str, float | None]]:
    """(overall hit rate, replica -> hit rate) between two read_prefix_cache_counters answers: the
    prompt tokens found in the prefix cache / looked up, over the run (None where none was looked up)."""
    if before is None or after is None:
        return None, {}
    per, hits, queries = {}, 0.0, 0.0
    for replica, (h, q) in after.items():
        h0, q0 = before.get(replica, (0.0, 0.0))
        per[replica] = (h - h0) / (q - q0) if q > q0 else None
        hits, queries = hits + h - h0, queries + q - q0
    return (hits / queries if queries > 0 else None), {r: v for r, v in per.items() if r}


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

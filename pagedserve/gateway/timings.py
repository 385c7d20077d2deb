"""A request's "timings" object: the wall-clock stamps each service took, in pipeline order, and the
time to first token split into the stages that make it up. Pure functions (the responses, the
request records of GET /v1/requests/{id} and /v1/engine/stats show it)."""

from __future__ import annotations

# The wall-clock stamps of a request, in pipeline order (0.0: not reached or not known).
TIMING_STAMPS = ("gateway_received", "tokenizer_received", "tokenized", "scheduler_received", "first_scheduled",
                 "prefill_end", "first_token", "first_token_streamed", "finished", "detokenized",
                 "last_token_streamed")
TIMING_COUNTS = ("prefill_chunks", "num_steps", "num_preemptions", "spec_draft_tokens", "spec_accepted_tokens")
# The stages that partition the time to first token: (name, the stamp that ends it).
TTFT_STAGES = (("gateway", "tokenizer_received"), ("tokenizer", "scheduler_received"),
               ("queue", "first_scheduled"), ("prefill", "first_token"), ("network", "first_token_streamed"))


def timings_object(stamps: dict) -> dict:
    """The "timings" object of a response, of GET /v1/requests/{id} and of /v1/engine/stats.

    ttft_ms runs from gateway_received to first_token_streamed; ttft_breakdown_ms splits it into
    five stages that sum to it (a stamp missing, or out of order across processes, makes its stage
    0 and the next stage takes the time). Both are None until first_token_streamed is known.
    """
    out = {key: value for key, value in stamps.items() if key not in TIMING_STAMPS + TIMING_COUNTS}
    for key in TIMING_STAMPS:
        out[key] = float(stamps.get(key) or 0.0)
    for key in TIMING_COUNTS:
        out[key] = int(stamps.get(key) or 0)
    out["worker_time_s"] = float(stamps.get("worker_time_s") or 0.0)
    start, end = out["gateway_received"], out["first_token_streamed"]
    if start > 0 and end > 0:
        end = max(end, start)
        breakdown, prev = {}, start
        for stage, stamp in TTFT_STAGES:
            at = min(max(out[stamp], prev), end) if out[stamp] > 0 else prev
            breakdown[stage] = (at - prev) * 1000.0
            prev = at
        total = 0.0
        for value in breakdown.values():
            total += value
        out["ttft_ms"], out["ttft_breakdown_ms"] = total, breakdown
    else:
        out["ttft_ms"], out["ttft_breakdown_ms"] = None, None
    last = out["last_token_streamed"]
    out["e2e_ms"] = (last - start) * 1000.0 if start > 0 and last >= start else None
    return out

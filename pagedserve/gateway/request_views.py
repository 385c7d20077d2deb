"""The JSON views the gateway builds from the scheduler's messages: one request's status and
timeline (GET /v1/requests/{id}) and the engine snapshot (GET /v1/engine/stats, the dashboard's
data). Pure functions of their inputs; no I/O."""

from __future__ import annotations

import time

from pagedserve.common import wire
from pagedserve.v1 import scheduler_pb2
from pagedserve.gateway.owners import SINGLE_TENANT, Caller
from pagedserve.gateway.timings import timings_object

# (stage, from stamp, to stamp): the order a request moves through the pipeline.
STAGES = [("gateway", "gateway_received", "tokenizer_received"),
          ("tokenizer", "tokenizer_received", "tokenized"),
          ("to_scheduler", "tokenized", "scheduler_received"),
          ("queue", "scheduler_received", "first_scheduled"),
          ("prefill", "first_scheduled", "first_token"),
          ("decode", "first_token", "finished"),
          ("detokenize", "finished", "detokenized"),
          ("network", "first_token", "first_token_streamed"),
          ("stream", "first_token_streamed", "last_token_streamed")]


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


def status_dict(request_id: str, status: str, priority: int, prompt_tokens: int, output_tokens: list[int],
                finish_reasons: list[str], timings: dict, cached_tokens: int | None) -> dict:
    t = {_snake(k): v for k, v in (timings or {}).items()}
    timeline = []
    for stage, start_key, end_key in STAGES:
        start, end = float(t.get(start_key) or 0), float(t.get(end_key) or 0)
        if start > 0 and end > 0:
            timeline.append({"stage": stage, "start": start, "end": end, "duration_s": round(end - start, 6)})
    reasons = list(finish_reasons) + [""] * (len(output_tokens) - len(finish_reasons))
    out = {"id": request_id, "object": "request", "status": status, "priority": priority,
           "prompt_tokens": prompt_tokens,
           "samples": [{"index": i, "output_tokens": n, "finish_reason": reasons[i] or None}
                       for i, n in enumerate(output_tokens)],
           "timeline": timeline, "timings": timings_object(t),
           "worker_time_s": float(t.get("worker_time_s") or 0), "num_steps": int(t.get("num_steps") or 0),
           "num_preemptions": int(t.get("num_preemptions") or 0), "checked_at": time.time()}
    if cached_tokens is not None:
        out["cached_tokens"] = cached_tokens
    return out


def _plain(msg) -> dict:
    """A message as a dict of plain values (numbers stay numbers, unlike MessageToDict's uint64)."""
    out = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None:
            value = [_plain(v) for v in value] if field.is_repeated else _plain(value)
        elif field.is_repeated:
            value = list(value)
        out[field.name] = value
    return out


def engine_stats_dict(msg: scheduler_pb2.EngineStats, steps: int, merge=None, caller: Caller = SINGLE_TENANT) -> dict:
    """The JSON of GET /v1/engine/stats. merge(request_id, stamps) adds the gateway's stamps. The
    caller sees its own requests, by its own ids (an operator: every request); the aggregates
    (block states, step budgets, totals) are everyone's and name no request."""
    def shown(ids) -> list[str]:
        return [caller.shown_id(i) for i in ids if caller.sees(i)]

    recent = []
    for rec in msg.recent_requests:
        if not caller.sees(rec.request_id):
            continue
        stamps = wire.timings_to_dict(rec.timings)
        if merge is not None:
            stamps = merge(rec.request_id, stamps)
        recent.append({"request_id": caller.shown_id(rec.request_id), "prompt_tokens": rec.prompt_tokens,
                       "output_tokens": rec.output_tokens, "finish_reason": rec.finish_reason,
                       "finish_reasons": list(rec.finish_reasons), "cached_tokens": rec.cached_tokens,
                       "adapter": rec.adapter,
                       "prefill_chunk_list": [{"time": c.time, "tokens": c.tokens} for c in rec.prefill_chunks],
                       "timings": timings_object(stamps)})
    totals = _plain(msg.totals)
    return {
        "time": msg.time or time.time(), "ready": msg.ready,
        "config": _plain(msg.config),
        "queues": {"waiting": shown(msg.waiting), "running": shown(msg.running), "swapped": shown(msg.swapped)},
        "queue_lengths": {"waiting": msg.num_waiting, "running": msg.num_running, "swapped": msg.num_swapped},
        "kv": {"num_blocks": msg.num_blocks, "states": msg.block_states,
               "tables": {caller.shown_id(t.request_id): list(t.block_ids) for t in msg.tables
                          if caller.sees(t.request_id)}},
        "steps": [_plain(step) for step in msg.steps][-steps:] if steps else [],
        "recent_requests": recent,
        "totals": totals,
    }

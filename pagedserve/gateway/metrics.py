"""Prometheus metrics of the gateway, with vLLM's names under a `pagedserve:` prefix.

Every sample carries a `model_name` label (the served model), and the metrics vLLM also has are
exposed a second time under its own `vllm:` names (VLLM_NAMES), so that vLLM's Grafana dashboard,
KEDA / HPA rules on `vllm:num_requests_waiting` and the like work unchanged.

Engine-wide numbers (queues, KV usage, token totals) live in the scheduler: they are read with
Scheduler.GetStats on each scrape. Per-request latencies are observed here when a request
finishes, from the stage stamps its last messages carry, so that an operator can see which stage
a slow first token spent its time in.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.common import wire
from pagedserve.v1 import common_pb2, generate_pb2, scheduler_pb2
from pagedserve.gateway.timings import timings_object

P = "pagedserve:"
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
LATENCY_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
STAGE_BUCKETS = [0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0, 120.0]


class SchedulerStatsCollector(Collector):
    """Exposes the last Scheduler.GetStats answer(s); the /metrics handler refreshes them first.
    With engine replicas (docs/scale-out.md) every engine sample carries a `replica` label, one
    sample per replica; a single engine's samples have none (as before)."""

    def __init__(self) -> None:
        self.stats: scheduler_pb2.SchedulerStats | None = None
        self.per_replica: list[tuple[str, scheduler_pb2.SchedulerStats]] = []

    def collect(self):
        up = GaugeMetricFamily(P + "scheduler_up", "1 when the last GetStats of this scrape answered")
        up.add_metric([], 1.0 if self.stats is not None or self.per_replica else 0.0)
        yield up
        answers = self.per_replica or ([("", self.stats)] if self.stats is not None else [])
        if not answers:
            return
        labels = ["replica"] if any(rid for rid, _ in answers) else []
        families: dict[str, Metric] = {}
        order: list[str] = []
        for rid, s in answers:
            for kind, name, doc, value in _engine_samples(s):
                family = families.get(name)
                if family is None:
                    order.append(name)
                    if kind == "histogram":
                        family = HistogramMetricFamily(P + name, doc, labels=labels)
                    elif kind in LABEL_OF:
                        family = CounterMetricFamily(P + name, doc, labels=[*labels, LABEL_OF[kind]])
                    else:
                        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                            P + name, doc, labels=labels)
                    families[name] = family
                key = [rid] if labels else []
                if kind == "histogram":
                    family.add_metric(key, buckets=_buckets(value), sum_value=value.sum)
                elif kind in LABEL_OF:
                    for reason, count in value:
                        family.add_metric([*key, reason], count)
                else:
                    family.add_metric(key, value)
        for name in order:
            yield families[name]


# Counters with one label of their own: kind -> the label's name.
LABEL_OF = {"labelled": "reason", "per_position": "position"}


def _spec_decode_samples(s: scheduler_pb2.SchedulerStats) -> list[tuple[str, str, str, object]]:
    """Speculative decoding's counters (vLLM's spec_decode_* names), only when it is on."""
    if not s.spec_decode_enabled:
        return []
    drafts, drafted, accepted = (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens,
                                 s.spec_decode_num_accepted_tokens)
    return [
        ("counter", "spec_decode_num_drafts", "Speculative decoding: rows that carried proposals", drafts),
        ("counter", "spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed", drafted),
        ("counter", "spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted", accepted),
        ("per_position", "spec_decode_num_accepted_tokens_per_pos",
         "Speculative decoding: proposals accepted at each position (0: the first)",
         [(str(pos), count) for pos, count in enumerate(s.spec_decode_num_accepted_tokens_per_pos)]),
        ("gauge", "spec_decode_acceptance_rate", "Speculative decoding: accepted / proposed tokens",
         accepted / drafted if drafted else 0.0),
        ("gauge", "spec_decode_mean_acceptance_length",
         "Speculative decoding: tokens a verified row yields on average (1 + accepted / drafts)",
         1 + accepted / drafts if drafts else 0.0),
    ]


def _engine_samples(s: scheduler_pb2.SchedulerStats) -> list[tuple[str, str, str, object]]:
    """(kind, name, help, value) of one scheduler's engine metrics, in exposition order."""
    usage = 1.0 - s.num_free_gpu_blocks / s.num_gpu_blocks if s.num_gpu_blocks else 0.0
    hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
    used = s.num_gpu_blocks - s.num_free_gpu_blocks
    g, c = "gauge", "counter"
    out = [
        (g, "num_requests_running", "Requests in the running batch", s.num_running),
        (g, "num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting),
        (g, "num_requests_swapped", "Requests swapped out to the host", s.num_swapped),
        (g, "kv_cache_usage_perc", "KV cache usage, 1 = full", usage),
        (g, "num_gpu_blocks", "KV cache blocks on the device", s.num_gpu_blocks),
        (g, "num_cached_blocks", "Free blocks still holding a reusable prefix", s.num_cached_blocks),
        (g, "prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up", hit_rate),
        (c, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
        (c, "prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits),
        (c, "num_preemptions", "Preemptions", s.num_preemptions),
        (c, "prompt_tokens", "Prompt tokens processed", s.prompt_tokens_total),
        (c, "generation_tokens", "Tokens generated", s.generation_tokens_total),
        (c, "engine_steps", "Engine steps run", s.num_steps),
        (c, "requests_finished", "Requests finished at the scheduler", s.requests_finished_total),
        (g, "step_rtt_median_seconds", "Scheduler->worker round trip minus worker time (median)",
         s.step_rtt_median_s),
        (g, "step_time_median_seconds", "Engine step time (median)", s.step_time_median_s),
        (g, "model_ready", "1 when the workers are loaded and the KV cache allocated", float(s.ready)),
        (g, "max_waiting_requests", "Waiting queue bound (429 beyond it)", s.max_waiting_requests),
        (g, "kv_blocks_used", "KV blocks in use by requests", used),
        (g, "kv_blocks_cached", "KV blocks free but holding a reusable prefix", s.num_cached_blocks),
        (g, "kv_blocks_free", "KV blocks free and holding nothing reusable",
         s.num_free_gpu_blocks - s.num_cached_blocks),
        (g, "max_num_seqs", "Sequences one step may run", s.max_num_seqs),
        (g, "max_num_batched_tokens", "Tokens one step may schedule", s.max_num_batched_tokens),
        (c, "scheduled_prefill_tokens", "Prompt (and recompute) tokens scheduled", s.scheduled_prefill_tokens_total),
        (c, "scheduled_decode_tokens", "Decode tokens scheduled", s.scheduled_decode_tokens_total),
        ("labelled", "waiting_reasons", "Requests left waiting after a step, per step, by why "
         "(no_blocks, seq_budget, token_budget)",
         [(r, getattr(s.waiting_reasons_total, r)) for r in ("no_blocks", "seq_budget", "token_budget")]),
    ]
    for name, doc, data in (
            ("step_scheduled_tokens", "Tokens scheduled per engine step", s.step_scheduled_tokens),
            ("step_token_budget_utilization", "Scheduled tokens / max_num_batched_tokens per step",
             s.step_token_budget_utilization),
            ("step_duration_seconds", "Engine step wall time at the scheduler", s.step_duration_seconds)):
        if data.bounds:
            out.append(("histogram", name, doc, data))
    return out + _spec_decode_samples(s)


def _buckets(data: scheduler_pb2.HistogramData) -> list[tuple[str, float]]:
    buckets, total = [], 0
    for bound, count in zip(list(data.bounds) + [float("inf")], data.counts):
        total += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return buckets


# pagedserve: names that vLLM exposes under vllm: with the same meaning (its v1 engine's names;
# gpu_cache_usage_perc is the older name of kv_cache_usage_perc that many dashboards still read).
VLLM_NAMES = {
    "num_requests_running": ["num_requests_running"], "num_requests_waiting": ["num_requests_waiting"],
    "num_requests_swapped": ["num_requests_swapped"],
    "kv_cache_usage_perc": ["kv_cache_usage_perc", "gpu_cache_usage_perc"],
    "prefix_cache_queries": ["prefix_cache_queries"], "prefix_cache_hits": ["prefix_cache_hits"],
    "num_preemptions": ["num_preemptions"], "prompt_tokens": ["prompt_tokens"],
    "generation_tokens": ["generation_tokens"], "request_success": ["request_success"],
    "time_to_first_token_seconds": ["time_to_first_token_seconds"],
    "time_per_output_token_seconds": ["time_per_output_token_seconds", "inter_token_latency_seconds"],
    "e2e_request_latency_seconds": ["e2e_request_latency_seconds"],
    "request_queue_time_seconds": ["request_queue_time_seconds"],
    "request_prefill_time_seconds": ["request_prefill_time_seconds"],
    "request_decode_time_seconds": ["request_decode_time_seconds"],
    "spec_decode_num_drafts": ["spec_decode_num_drafts"],
    "spec_decode_num_draft_tokens": ["spec_decode_num_draft_tokens"],
    "spec_decode_num_accepted_tokens": ["spec_decode_num_accepted_tokens"],
    "spec_decode_num_accepted_tokens_per_pos": ["spec_decode_num_accepted_tokens_per_pos"],
}


class ModelNamedView(Collector):
    """Every family of `inner` with a model_name label on each sample, and again under vLLM's
    name where VLLM_NAMES has one. model_name() is read at each scrape (the gateway learns the
    served model's name from the tokenizer once it answers)."""

    def __init__(self, inner: CollectorRegistry, model_name) -> None:
        self.inner, self.model_name = inner, model_name

    def collect(self):
        model = self.model_name() or ""
        for family in self.inner.collect():
            short = family.name.removeprefix(P)
            for prefix, name in [(P, short)] + [("vllm:", alias) for alias in VLLM_NAMES.get(short, [])]:
                out = Metric(prefix + name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    out.add_sample(prefix + name + sample.name[len(family.name):],
                                   {**sample.labels, "model_name": model}, sample.value, sample.timestamp,
                                   sample.exemplar)
                yield out


RECENT_TIMINGS = 4096  # finished requests whose gateway-side stamps are kept for /v1/requests and engine stats


class Metrics:
    def __init__(self) -> None:
        self.recent: OrderedDict[str, dict] = OrderedDict()
        self.registry = CollectorRegistry()
        self.scheduler = SchedulerStatsCollector()
        self.registry.register(self.scheduler)

        def hist(name: str, doc: str, buckets: list[float], labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(P + name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Receipt at the gateway to the first text sent",
                         TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Time per output token after the first", TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Receipt at the gateway to the last text sent",
                        LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Scheduler receipt to first scheduled", LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token", LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to finished", LATENCY_BUCKETS)
        self.stage = hist("request_stage_seconds", "Time a request spent in each stage before its first token",
                          STAGE_BUCKETS, ("stage",))
        self.finished = Counter(P + "request_success", "Requests finished, by finish reason", ["finished_reason"],
                                registry=self.registry)
        # LoRA (--enable-lora): requests and output tokens per adapter ("" : the base model)
        self.adapter_requests = Counter(P + "adapter_requests", "Requests finished, by LoRA adapter and finish "
                                        "reason", ["adapter", "finished_reason"], registry=self.registry)
        self.adapter_tokens = Counter(P + "adapter_generation_tokens", "Output tokens, by LoRA adapter",
                                      ["adapter"], registry=self.registry)
        self.http = Counter(P + "http_requests", "HTTP responses, by endpoint and status", ["endpoint", "status"],
                            registry=self.registry)
        self.model_name = ""  # the served model's name, once the tokenizer said it
        self.exposed = CollectorRegistry()
        self.exposed.register(ModelNamedView(self.registry, lambda: self.model_name))

    def render(self, stats: scheduler_pb2.SchedulerStats | None,
               per_replica: list[tuple[str, scheduler_pb2.SchedulerStats]] | None = None) -> bytes:
        """The exposition; per_replica: each engine replica's stats (a `replica` label each)."""
        self.scheduler.stats = stats
        self.scheduler.per_replica = per_replica or []
        return generate_latest(self.exposed)

    def track(self, received: float) -> RequestTracker:
        return RequestTracker(self, received)

    def remember(self, request_id: str, stamps: dict) -> None:
        self.recent[request_id] = stamps
        self.recent.move_to_end(request_id)
        while len(self.recent) > RECENT_TIMINGS:
            self.recent.popitem(last=False)

    def merged_stamps(self, request_id: str, stamps: dict) -> dict:
        """stamps (from the scheduler or the store) with what this gateway saw of the request."""
        mine = self.recent.get(request_id)
        if not mine:
            return dict(stamps)
        merged = dict(stamps)
        for key, value in mine.items():
            if value:
                merged[key] = value
        return merged


def _span(start: float, end: float) -> float | None:
    return end - start if start > 0 and end > 0 and end >= start else None


class RequestTracker:
    """Follows one request's messages; observes its histograms once, when every sample is done."""

    def __init__(self, metrics: Metrics, received: float) -> None:
        self.metrics, self.received = metrics, received
        self.first_text: float | None = None
        self.last_text: float | None = None
        self.finish_reasons: dict[int, str] = {}
        self.completion_tokens: dict[int, int] = {}
        self.timings: common_pb2.Timings | None = None
        self.done = False
        self.request_id = ""
        self.adapter = ""  # the LoRA adapter the request named ("": the base model)
        self.first_streamed: float | None = None  # when the gateway wrote the first / last text
        self.last_streamed: float | None = None

    def streamed(self) -> None:
        """The gateway is writing a chunk with text to the client now."""
        now = time.time()
        self.last_streamed = now
        if self.first_streamed is None:
            self.first_streamed = now

    def all_finished(self, n: int) -> bool:
        return len(self.finish_reasons) >= n

    def stamps(self) -> dict:
        """Every stamp known here: the pipeline's (from the last message) and the gateway's own."""
        out = wire.timings_to_dict(self.timings) if self.timings is not None else {}
        out["gateway_received"] = out.get("gateway_received") or self.received
        first, last = self.first_streamed or self.first_text, self.last_streamed or self.last_text
        if first:
            out["first_token_streamed"] = first
        if last:
            out["last_token_streamed"] = last
        return out

    def timings_object(self) -> dict:
        return timings_object(self.stamps())

    def on_message(self, msg: generate_pb2.GenerateResponse) -> None:
        if msg.accepted:
            return
        now = time.time()
        if msg.text or msg.token_ids:
            self.last_text = now
            if self.first_text is None:
                self.first_text = now
        self.completion_tokens[msg.index] = self.completion_tokens.get(msg.index, 0) + len(msg.token_ids)
        if msg.finish_reason:
            self.finish_reasons[msg.index] = msg.finish_reason
            if msg.HasField("usage") and msg.usage.completion_tokens:
                self.completion_tokens[msg.index] = msg.usage.completion_tokens
            if msg.HasField("timings"):
                self.timings = msg.timings

    def finish(self, n: int, cancelled: bool = False) -> None:
        """Call once the relay ends (normally, on error or on disconnect)."""
        if self.done:
            return
        self.done = True
        m = self.metrics
        if self.request_id:
            m.remember(self.request_id, self.stamps())
        if cancelled or len(self.finish_reasons) < n:
            m.finished.labels("cancelled" if cancelled else "error").inc()
            return
        for reason in self.finish_reasons.values():
            m.finished.labels(reason).inc()
            m.adapter_requests.labels(self.adapter, reason).inc()
        m.adapter_tokens.labels(self.adapter).inc(sum(self.completion_tokens.values()))
        end = self.last_text or time.time()
        m.e2e.observe(end - self.received)
        if self.first_text is not None:
            m.ttft.observe(self.first_text - self.received)
            tokens = max(self.completion_tokens.values(), default=0)
            if tokens > 1:
                m.tpot.observe((end - self.first_text) / (tokens - 1))
        t = self.timings
        if t is None:
            return
        for hist, span in ((m.queue, _span(t.scheduler_received, t.first_scheduled)),
                           (m.prefill, _span(t.first_scheduled, t.first_token)),
                           (m.decode, _span(t.first_token, t.finished))):
            if span is not None:
                hist.observe(span)
        stages = {"gateway": _span(t.gateway_received, t.tokenizer_received),
                  "tokenizer": _span(t.tokenizer_received, t.tokenized),
                  "tokenizer_to_scheduler": _span(t.tokenized, t.scheduler_received),
                  "scheduler_queue": _span(t.scheduler_received, t.first_scheduled),
                  "worker": t.worker_time_s if t.worker_time_s > 0 else None}
        for stage, span in stages.items():
            if span is not None:
                m.stage.labels(stage).observe(span)
        breakdown = self.timings_object()["ttft_breakdown_ms"]
        for stage, ms in (breakdown or {}).items():
            m.stage.labels("ttft_" + stage).observe(ms / 1000.0)

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
from pagedserve.gateway.responses import timings_object

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
    """Exposes the last Scheduler.GetStats answer; the /metrics handler refreshes it first."""

    def __init__(self) -> None:
        self.stats: scheduler_pb2.SchedulerStats | None = None

    def collect(self):
        up = GaugeMetricFamily(P + "scheduler_up", "1 when the last GetStats of this scrape answered")
        up.add_metric([], 1.0 if self.stats is not None else 0.0)
        yield up
        s = self.stats
        if s is None:
            return

        def gauge(name: str, doc: str, value: float):
            return GaugeMetricFamily(P + name, doc, value=value)

        def counter(name: str, doc: str, value: float):
            return CounterMetricFamily(P + name, doc, value=value)

        yield gauge("num_requests_running", "Requests in the running batch", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting)
        yield gauge("num_requests_swapped", "Requests swapped out to the host", s.num_swapped)
        usage = 1.0 - s.num_free_gpu_blocks / s.num_gpu_blocks if s.num_gpu_blocks else 0.0
        yield gauge("kv_cache_usage_perc", "KV cache usage, 1 = full", usage)
        yield gauge("num_gpu_blocks", "KV cache blocks on the device", s.num_gpu_blocks)
        yield gauge("num_cached_blocks", "Free blocks still holding a reusable prefix", s.num_cached_blocks)
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up", hit_rate)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits)
        yield counter("num_preemptions", "Preemptions", s.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens processed", s.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated", s.generation_tokens_total)
        yield counter("engine_steps", "Engine steps run", s.num_steps)
        yield counter("requests_finished", "Requests finished at the scheduler", s.requests_finished_total)
        yield gauge("step_rtt_median_seconds", "Scheduler->worker round trip minus worker time (median)",
                    s.step_rtt_median_s)
        yield gauge("step_time_median_seconds", "Engine step time (median)", s.step_time_median_s)
        yield gauge("model_ready", "1 when the workers are loaded and the KV cache allocated", float(s.ready))
        yield gauge("max_waiting_requests", "Waiting queue bound (429 beyond it)", s.max_waiting_requests)
        used = s.num_gpu_blocks - s.num_free_gpu_blocks
        yield gauge("kv_blocks_used", "KV blocks in use by requests", used)
        yield gauge("kv_blocks_cached", "KV blocks free but holding a reusable prefix", s.num_cached_blocks)
        yield gauge("kv_blocks_free", "KV blocks free and holding nothing reusable",
                    s.num_free_gpu_blocks - s.num_cached_blocks)
        yield gauge("max_num_seqs", "Sequences one step may run", s.max_num_seqs)
        yield gauge("max_num_batched_tokens", "Tokens one step may schedule", s.max_num_batched_tokens)
        yield counter("scheduled_prefill_tokens", "Prompt (and recompute) tokens scheduled",
                      s.scheduled_prefill_tokens_total)
        yield counter("scheduled_decode_tokens", "Decode tokens scheduled", s.scheduled_decode_tokens_total)
        reasons = CounterMetricFamily(P + "waiting_reasons", "Requests left waiting after a step, per step, by why "
                                      "(no_blocks, seq_budget, token_budget)", labels=["reason"])
        for reason in ("no_blocks", "seq_budget", "token_budget"):
            reasons.add_metric([reason], getattr(s.waiting_reasons_total, reason))
        yield reasons
        for name, doc, data in (
                ("step_scheduled_tokens", "Tokens scheduled per engine step", s.step_scheduled_tokens),
                ("step_token_budget_utilization", "Scheduled tokens / max_num_batched_tokens per step",
                 s.step_token_budget_utilization),
                ("step_duration_seconds", "Engine step wall time at the scheduler", s.step_duration_seconds)):
            if data.bounds:
                yield _histogram(P + name, doc, data)


def _histogram(name: str, doc: str, data: scheduler_pb2.HistogramData) -> HistogramMetricFamily:
    buckets, total = [], 0
    for bound, count in zip(list(data.bounds) + [float("inf")], data.counts):
        total += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=data.sum)


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
        self.http = Counter(P + "http_requests", "HTTP responses, by endpoint and status", ["endpoint", "status"],
                            registry=self.registry)
        self.model_name = ""  # the served model's name, once the tokenizer said it
        self.exposed = CollectorRegistry()
        self.exposed.register(ModelNamedView(self.registry, lambda: self.model_name))

    def render(self, stats: scheduler_pb2.SchedulerStats | None) -> bytes:
        self.scheduler.stats = stats
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

"""The planner's simulator drives the real Scheduler: replaying a trace gives the same scheduling
decisions, step by step, as the in-process engine running the tiny model on that trace when every
step lasts the same (one unit of virtual time); preemptions and prefix-cache hits included."""

from __future__ import annotations

import dataclasses

from tiny_models import make_engine

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.planner.simulator import Simulator
from pagedserve.planner.trace import TraceRequest


def small_trace() -> list[TraceRequest]:
    shared = list(range(10, 58))  # 48 tokens: three full blocks that later requests find cached
    prompts = [shared + [60, 61, 62], list(range(100, 170)), shared + [70] * 9, list(range(200, 211)),
               list(range(120, 150)), shared + [80, 81], list(range(30, 95)), list(range(5, 9))]
    arrivals = [0, 0, 1, 3, 3, 4, 9, 9]
    outputs = [12, 20, 6, 9, 15, 4, 10, 7]
    return [TraceRequest(float(a), p, o) for a, p, o in zip(arrivals, prompts, outputs)]


def engine_decisions(engine, trace: list[TraceRequest]) -> list[tuple]:
    """Steps of the real engine in the simulator's clock: a step lasts 1; requests that arrived by
    a step's start are added before it (in trace order), as the simulator admits them."""
    pending = sorted(range(len(trace)), key=lambda i: (trace[i].arrival_s, i))
    now, steps = 0.0, []
    while pending or engine.has_unfinished():
        while pending and trace[pending[0]].arrival_s <= now:
            i = pending.pop(0)
            engine.add_request(f"r{i}", trace[i].prompt_token_ids,
                               SamplingParams(temperature=0.0, max_tokens=trace[i].output_tokens, ignore_eos=True))
        if not engine.has_unfinished():
            now = trace[pending[0]].arrival_s
            continue
        before = engine.scheduler.num_preemptions
        engine.step()
        sched = engine.scheduler
        steps.append((now, tuple(engine.last_scheduled), sched.num_preemptions - before))
        now += 1.0
    return steps


def test_simulator_makes_the_engines_scheduling_decisions(tiny_llama):
    # 12 blocks of 16 tokens for 8 requests of up to 90 tokens: preemptions happen; 64-token steps
    # with a 16-token prefill cap: chunked prefills beside decodes.
    engine = make_engine(tiny_llama, kv_cache_memory=12 * 8192, max_num_batched_tokens=64, max_num_seqs=4)
    config = dataclasses.replace(engine.scheduler.config)
    original_schedule = engine.scheduler.schedule

    def schedule():
        out = original_schedule()
        engine.last_scheduled = list(out.num_scheduled_tokens.items())
        return out

    engine.scheduler.schedule = schedule
    trace = small_trace()
    real = engine_decisions(engine, trace)
    sim = Simulator(config, lambda shape: 1.0).run(trace)
    simulated = [(s.start_s, s.scheduled, s.preemptions) for s in sim.steps]
    assert simulated == real
    assert sim.num_preemptions > 0, "the trace should exercise preemption"
    assert sim.prefix_cache_hits > 0, "the trace should exercise the prefix cache"
    assert any(s.prefill_tokens and s.decode_seqs for s in sim.steps), "and mixed steps"
    # Every request got its trace's output length.
    assert [len(t.token_s) for t in sim.requests] == [r.output_tokens for r in trace]


def test_concurrency_cap_holds_requests_at_the_client():
    from pagedserve.scheduler.core.scheduler import SchedulerConfig

    trace = [TraceRequest(0.0, list(range(10 + i, 30 + i)), 5) for i in range(6)]
    sim = Simulator(SchedulerConfig(num_gpu_blocks=64), lambda shape: 0.01, max_concurrency=2).run(trace)
    sends = sorted(t.send_s for t in sim.requests)
    assert sends[:2] == [0.0, 0.0] and all(s > 0 for s in sends[2:])
    assert max(max(s.running for s in sim.steps), 0) <= 2
    # A request is sent when an earlier one finishes.
    finishes = sorted(t.finish_s for t in sim.requests)
    assert sends[2] == finishes[0]

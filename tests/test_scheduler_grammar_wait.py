"""Requests wait for their grammar (vLLM's WAITING_FOR_FSM; scheduler/core/grammar_wait.py): the
scheduler asks the worker for a structured request's grammar once, keeps the request waiting and
unscheduled until a step result says it is compiled, and runs everything else meanwhile."""

from __future__ import annotations

import dataclasses

from pagedserve.common.messages import ModelRunnerOutput, SampledToken
from pagedserve.common.sampling_params import StructuredOutput
from pagedserve.scheduler.core.grammar_wait import MAX_WAIT_S, GrammarWait
from pagedserve.scheduler.core.request import RequestStatus
from pagedserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler_driver import make_request

SCHEMA = StructuredOutput(json_schema='{"type": "object", "properties": {"a": {"type": "integer"}}}')
REGEX = StructuredOutput(regex="[0-9]+")


def structured(req_id: str, spec: StructuredOutput, prompt=(1, 2, 3), arrival: float = 0.0):
    req = make_request(req_id, list(prompt), arrival=arrival)
    req.params = dataclasses.replace(req.params, structured_output=spec)
    return req


def run(sched: Scheduler, ready=(), ahead: bool = False):
    """One step, its result sampling token 7 for every row that reached its end; ready: the keys it reports."""
    out = sched.schedule(ahead=ahead)
    if out is None:
        return None, []
    sampled = {r: [SampledToken(7)] for r, n in out.num_scheduled_tokens.items()
               if sched.requests[r].num_computed_tokens + n >= sched.requests[r].num_tokens}
    sched.update(out, ModelRunnerOutput(out.step_id, sampled, grammars_ready=list(ready)))
    return out, sampled


def config(**kwargs) -> SchedulerConfig:
    return SchedulerConfig(**{"num_gpu_blocks": 64, "block_size": 4, "max_model_len": 64, **kwargs})


def test_a_structured_request_waits_for_its_grammar_and_the_rest_run():
    sched = Scheduler(config())
    sched.add_request(structured("s", SCHEMA, arrival=0.0))  # first in the queue
    sched.add_request(make_request("p", [4, 5, 6], arrival=1.0))
    out, _ = run(sched)
    assert out.grammars == [SCHEMA]  # asked for once, with the first step
    assert list(out.num_scheduled_tokens) == ["p"]  # the one behind it is not held up
    assert sched.requests["s"].status is RequestStatus.WAITING and sched.waiting[0].request_id == "s"
    for _ in range(3):  # not compiled yet: it keeps waiting, and is not asked for again
        out, _ = run(sched)
        assert out.grammars == [] and list(out.num_scheduled_tokens) == ["p"]
    out, _ = run(sched, ready=[SCHEMA.key()])
    assert "s" not in out.num_scheduled_tokens  # (the result came with this step)
    out, _ = run(sched)
    assert out.num_scheduled_tokens == {"p": 1, "s": 3}
    assert sched.requests["s"].status is RequestStatus.RUNNING


def test_one_ask_a_grammar_and_the_next_request_of_it_does_not_wait():
    sched = Scheduler(config())
    sched.add_request(structured("a", SCHEMA))
    sched.add_request(structured("b", SCHEMA))
    sched.add_request(structured("c", REGEX))
    out, _ = run(sched)
    assert out.grammars == [SCHEMA, REGEX] and not out.num_scheduled_tokens  # an empty step: the poll
    out, _ = run(sched, ready=[REGEX.key()])
    assert out.grammars == [] and not out.num_scheduled_tokens
    out, _ = run(sched)
    assert list(out.num_scheduled_tokens) == ["c"]
    run(sched, ready=[SCHEMA.key()])
    out, _ = run(sched)
    assert set(out.num_scheduled_tokens) == {"a", "b", "c"}
    sched.add_request(structured("d", SCHEMA))  # compiled already: admitted at once, nothing asked
    out, _ = run(sched)
    assert out.grammars == [] and "d" in out.num_scheduled_tokens


def test_a_step_that_does_not_go_ahead_keeps_its_asks():
    sched = Scheduler(config())
    sched.add_request(structured("s", SCHEMA))
    assert sched.schedule(ahead=True) is None  # nothing to run ahead: no step...
    out, _ = run(sched)
    assert out.grammars == [SCHEMA]  # ...and the ask goes with the next one


def test_a_new_worker_session_is_asked_again():
    sched = Scheduler(config())
    sched.add_request(structured("s", SCHEMA))
    out, _ = run(sched)
    assert out.grammars == [SCHEMA]
    sched.preempt_all_for_new_session(64, 0)  # the worker restarted: its grammars are gone
    out, _ = run(sched)
    assert out.grammars == [SCHEMA] and not out.num_scheduled_tokens
    run(sched, ready=[SCHEMA.key()])
    out, _ = run(sched)
    assert "s" in out.num_scheduled_tokens


def test_an_aborted_waiting_request_leaves_nothing():
    sched = Scheduler(config())
    sched.add_request(structured("s", SCHEMA))
    run(sched)
    assert sched.abort("s")
    assert not sched.has_unfinished() and not sched.requests and not sched.waiting


def test_the_ready_keys_are_an_lru_as_large_as_the_workers_cache():
    wait = GrammarWait(kept=2)
    specs = [StructuredOutput(regex=f"[0-{i}]") for i in range(3)]
    assert all(wait.holds(s) for s in specs)
    assert wait.take_asks() == specs and wait.take_asks() == []
    wait.ready([s.key() for s in specs])  # the first one drops out
    assert not wait.holds(specs[1]) and not wait.holds(specs[2])
    assert wait.holds(specs[0]) and wait.take_asks() == [specs[0]]  # asked again
    assert not wait.holds(None)


def test_a_grammar_never_reported_ready_holds_its_requests_no_longer_than_the_bound():
    now = [0.0]
    wait = GrammarWait(clock=lambda: now[0])
    assert wait.holds(SCHEMA) and wait.take_asks() == [SCHEMA]
    now[0] = MAX_WAIT_S
    assert wait.holds(SCHEMA) and wait.take_asks() == []
    now[0] = MAX_WAIT_S + 1  # the worker never said: the requests go, and compile when they first sample
    assert not wait.holds(SCHEMA) and not wait.holds(SCHEMA)

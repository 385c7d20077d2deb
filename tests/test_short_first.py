"""Short prompts ahead of a long prefill (scheduler/core/short_first.py): a prompt that fits in one chunk
runs in a step of its own beside the decodes while a longer one prefills, the long one yields at most
every other step and only when a short prompt comes in its place, and every request's tokens stay
those of its prompt alone."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.core.scheduler import SchedulerConfig
from pagedserve.scheduler.core.short_first import yielding_prefills
from scheduler_driver import Driver, assert_drained, expected_outputs, make_request

LONG = list(range(100, 160))  # 60 tokens: 6 chunks of 10


def config(**overrides) -> SchedulerConfig:
    settings = dict(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=32, long_prefill_token_threshold=10)
    return SchedulerConfig(**(settings | overrides))


def short_prompt(arrival: float, size: int = 6) -> list[int]:
    start = 300 + 10 * int(arrival)  # a prompt of its own: no prefix-cache hit on another's
    return list(range(start, start + size))


def short(name: str, arrival: float, size: int = 6) -> object:
    return make_request(name, short_prompt(arrival, size), max_tokens=3, arrival=arrival)


def test_a_short_prompt_runs_in_its_own_step_beside_the_decodes_while_a_long_one_prefills():
    d = Driver(config())
    d.add(make_request("dec", [1, 2, 3], max_tokens=20, arrival=0))
    d.step()
    d.add(make_request("long", LONG, max_tokens=2, arrival=1))
    assert d.step().num_scheduled_tokens == {"dec": 1, "long": 10}
    d.add(short("s1", 2))
    assert d.step().num_scheduled_tokens == {"dec": 1, "s1": 6}  # the long chunk waits a step
    d.add(short("s2", 3))
    # It yielded in the step before: it runs now, then the short one behind it (first come, first served).
    assert d.step().num_scheduled_tokens == {"dec": 1, "s1": 1, "long": 10, "s2": 6}
    d.add(short("s3", 4))
    assert d.step().num_scheduled_tokens == {"dec": 1, "s1": 1, "s2": 1, "s3": 6}  # and yields again
    assert d.step().num_scheduled_tokens["long"] == 10
    d.run()
    d.flush()
    assert d.outputs["long"] == expected_outputs(LONG, 2)[0]
    for arrival, name in enumerate(("s1", "s2", "s3"), start=2):
        assert d.outputs[name] == expected_outputs(short_prompt(arrival), 3)[0]
    assert_drained(d.sched)


def test_the_long_prefill_keeps_at_least_every_other_step_under_a_stream_of_short_prompts():
    d = Driver(config())
    d.add(make_request("long", LONG, max_tokens=1, arrival=0))
    d.step()
    chunks = []
    for i in range(12):
        d.add(short(f"s{i}", 1 + i, size=3))
        chunks.append(d.step().num_scheduled_tokens.get("long", 0))
        if "long" in d.outputs:
            break
    assert chunks[:4] == [0, 10, 0, 10] and sum(chunks) == 50
    assert d.outputs["long"] == expected_outputs(LONG, 1)[0]


@pytest.mark.parametrize("case", ["long-head", "seats-full", "off", "no-cap", "short-remainder"])
def test_the_long_prefill_runs_when_no_short_prompt_takes_its_place(case):
    overrides = {"seats-full": dict(max_num_seqs=2), "off": dict(short_prompts_first=False),
                 "no-cap": dict(long_prefill_token_threshold=0)}.get(case, {})
    d = Driver(config(**overrides))
    d.add(make_request("dec", [1, 2, 3], max_tokens=20, arrival=0))
    d.step()
    long = LONG[:15] if case == "short-remainder" else LONG
    d.add(make_request("long", long, max_tokens=2, arrival=1))
    first = d.step().num_scheduled_tokens["long"]
    waiting = make_request("other", list(range(200, 240)), arrival=2) if case == "long-head" else short("s", 2)
    d.add(waiting)
    step = d.step().num_scheduled_tokens
    assert step["long"] == min(len(long) - first, first)  # its next chunk, or what is left
    assert ("s" in step) == (case in ("off", "no-cap", "short-remainder"))
    d.run()
    d.flush()
    assert d.outputs["long"] == expected_outputs(long, 2)[0]
    assert_drained(d.sched)


def test_ahead_steps_follow_the_rule_too():
    """Async scheduling (each step scheduled while the one before runs, as the engine does on a GPU): the
    short prompt still gets a step of its own, and every prompt's tokens are its own."""
    d = Driver(config(), ahead=True)
    d.add(make_request("dec", [1, 2, 3], max_tokens=30, arrival=0))
    d.step()
    d.add(make_request("long", LONG, max_tokens=2, arrival=1))
    d.step()
    d.add(short("s", 2))
    d.run()
    d.flush()
    alone = [out.num_scheduled_tokens for out in d.steps if out.num_scheduled_tokens.get("s") == 6]
    assert alone and "long" not in alone[0]
    assert d.outputs["long"] == expected_outputs(LONG, 2)[0]
    assert d.outputs["s"] == expected_outputs(short_prompt(2), 3)[0]
    assert_drained(d.sched)


def test_yielding_prefills_is_the_rule_alone():
    sched = Driver(config()).sched
    long = make_request("long", LONG, arrival=0)
    long.first_step = 3  # first scheduled in step 3
    head = short("s", 1)
    head.queued_step = 4  # added after step 4 was scheduled
    assert yielding_prefills([long], [head], 10, step_id=5) == [long]
    head.queued_step = 2  # it was waiting before the long prompt began: first come, first served
    assert yielding_prefills([long], [head], 10, step_id=5) == []
    head.queued_step = 3  # added while step 3, the long prompt's first, ran
    assert yielding_prefills([long], [head], 10, step_id=5) == [long]
    assert yielding_prefills([long], [head], 0, step_id=5) == []
    assert yielding_prefills([long], [], 10, step_id=5) == []
    assert yielding_prefills([long], [make_request("l2", LONG, arrival=1)], 10, step_id=5) == []
    long.yielded_step = 4
    assert yielding_prefills([long], [head], 10, step_id=5) == []
    assert yielding_prefills([long], [head], 10, step_id=6) == [long]
    assert sched.config.short_prompts_first


def test_a_yielded_step_takes_only_the_short_prompts_at_the_head_of_the_queue():
    d = Driver(config())
    d.add(make_request("long", LONG, max_tokens=2, arrival=0))
    d.step()
    d.add(short("s", 1), make_request("long2", list(range(400, 440)), max_tokens=2, arrival=2), short("t", 3))
    assert d.step().num_scheduled_tokens == {"s": 6}  # long2 waits its turn, and t behind it
    assert d.step().num_scheduled_tokens == {"s": 1, "long": 10, "long2": 10, "t": 6}


def test_the_engine_gives_each_prompt_transformers_tokens_and_the_short_ones_a_step_of_their_own(tiny_llama):
    """The in-process engine (a tiny random Llama, float32) with a long prompt prefilling in chunks of 8
    and short prompts arriving meanwhile: each short prompt's prefill runs in a step without the long
    chunk (first come, first served: with it), and every prompt's greedy tokens are transformers'."""
    import numpy as np

    from tiny_models import hf_greedy, make_engine
    from pagedserve.common.sampling_params import SamplingParams

    rng = np.random.default_rng(7)
    long_prompt = rng.integers(1, 250, 70).tolist()
    shorts = [rng.integers(1, 250, 5).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = hf_greedy(tiny_llama, [long_prompt, *shorts], 4)
    for rule in (True, False):
        engine = make_engine(tiny_llama, max_num_batched_tokens=32, long_prefill_token_threshold=8)
        engine.scheduler.config.short_prompts_first = rule
        steps = []

        def noted(*args, schedule=engine.scheduler.schedule, steps=steps, **kwargs):  # the real one, noted
            steps.append(schedule(*args, **kwargs))
            return steps[-1]

        engine.scheduler.schedule = noted
        engine.add_request("long", long_prompt, params)
        tokens: dict[str, list[int]] = {}
        for step in range(60):
            if step in (1, 4, 7):
                engine.add_request(f"s{step // 3}", shorts[step // 3], params)
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(t.token_id for t in out.new_tokens)
            if not engine.has_unfinished() and step > 7:
                break
        assert [tokens["long"], *(tokens[f"s{i}"] for i in range(3))] == expected
        prefills = [s.num_scheduled_tokens for s in steps if s and any(s.num_scheduled_tokens.get(f"s{i}") == 5
                                                                        for i in range(3))]
        assert len(prefills) == 3
        assert all(("long" in p) != rule for p in prefills), (rule, prefills)


def test_prompts_waiting_together_keep_first_come_first_served():
    """A batch submitted at once (a long prompt first, short ones behind it, as W64's are): no step yields,
    the steps are those of first come, first served."""
    steps = {}
    for rule in (True, False):
        d = Driver(config(short_prompts_first=rule))
        d.add(make_request("long", LONG, max_tokens=2, arrival=0),
              *(short(f"s{i}", 1 + i) for i in range(4)))
        d.run()
        steps[rule] = [dict(out.num_scheduled_tokens) for out in d.steps]
        assert d.outputs["long"] == expected_outputs(LONG, 2)[0]
    assert steps[True] == steps[False]

"""When the step loop sends a step ahead of the running one's results (scheduler/ahead_policy.py):
at once behind short decode steps, shortly before the expected end behind longer ones, never
behind prompt tokens or an untimed or larger batch."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.ahead_policy import LEAD_FRACTION, SHORT_STEP_S, AheadPolicy
from pagedserve.scheduler.core.step_stats import StepStats


def decode(seqs: int) -> StepStats:
    return StepStats(scheduled_tokens=seqs, decode_tokens=seqs, num_seqs=seqs)


def mixed(seqs: int, prompt: int) -> StepStats:
    return StepStats(scheduled_tokens=seqs + prompt, prefill_tokens=prompt, decode_tokens=seqs, num_seqs=seqs + 1)


def test_nothing_goes_ahead_before_a_decode_step_was_timed_or_behind_prompt_tokens():
    policy = AheadPolicy()
    assert policy.send_at(decode(4), 10.0) is None
    policy.took_results(mixed(3, 200), 0.005, 10.0)  # a step with prompt tokens predicts nothing
    assert policy.send_at(decode(4), 10.0) is None
    policy.took_results(decode(4), 0.005, 10.1)
    assert policy.send_at(mixed(4, 100), 10.2) is None


def test_behind_short_decode_steps_the_next_goes_at_once():
    policy = AheadPolicy()
    policy.took_results(decode(1), SHORT_STEP_S / 2, 5.0)
    assert policy.send_at(decode(1), 5.001) == 5.001
    assert policy.send_at(decode(40), 5.001) == 5.001  # however many sequences


def test_behind_long_decode_steps_the_next_goes_shortly_before_the_expected_end():
    policy = AheadPolicy()
    policy.took_results(decode(32), 0.060, 1.0)
    policy.took_results(decode(32), 0.050, 2.0)  # the shorter of the last two predicts
    # Sent after the last results: it started when sent.
    assert policy.send_at(decode(30), 2.001) == pytest.approx(2.001 + 0.050 * (1 - LEAD_FRACTION))
    # Sent ahead earlier: it started when the step before it ended, about when its results came in.
    assert policy.send_at(decode(30), 1.99) == pytest.approx(2.0 + 0.050 * (1 - LEAD_FRACTION))
    policy.took_results(decode(32), 0.019, 3.0)  # a short step: the next goes at once
    assert policy.send_at(decode(32), 3.0) == 3.0


def test_a_larger_batch_does_not_predict_a_smaller_one():
    policy = AheadPolicy()
    policy.took_results(decode(64), 0.080, 1.0)
    policy.took_results(decode(64), 0.080, 1.1)
    assert policy.send_at(decode(16), 1.1) is None  # far fewer sequences: a shorter step, unknown
    assert policy.send_at(decode(60), 1.1) is not None
    policy.took_results(decode(16), 0.030, 1.2)
    assert policy.send_at(decode(16), 1.2) == pytest.approx(1.2 + 0.030 * (1 - LEAD_FRACTION))

"""When a sample stops (pagedserve/common/stop_rules.py), the one rule the scheduler's results,
its ahead-step planning, the record writer and the worker's sampling all call."""

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.stop_rules import at_length, finish_reason, samples_any, stops_on

EOS = (2,)


def test_a_stop_token_counts_once_min_tokens_are_out():
    params = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[7])
    assert not stops_on(7, 2, params, EOS) and stops_on(7, 3, params, EOS)
    assert stops_on(2, 3, params, EOS) and not stops_on(5, 3, params, EOS)


def test_ignore_eos_leaves_the_stop_ids():
    params = SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[7])
    assert not stops_on(2, 1, params, EOS) and stops_on(7, 1, params, EOS)


def test_length_is_max_tokens_or_the_context():
    params = SamplingParams(max_tokens=4)
    assert not at_length(3, 10, params, 100) and at_length(4, 10, params, 100)
    assert at_length(2, 98, params, 100) and not at_length(1, 98, params, 100)


def test_finish_reason_of_stored_outputs():
    params = SamplingParams(max_tokens=3, stop_token_ids=[7])
    assert finish_reason([], 5, params, EOS, 100) == ""
    assert finish_reason([1, 7], 5, params, EOS, 100) == "stop"
    assert finish_reason([1, 1, 1], 5, params, EOS, 100) == "length"
    assert finish_reason([1, 1, 7], 5, params, EOS, 100) == "stop"  # a stop token wins over the length
    assert finish_reason([1], 99, params, EOS, 100) == "length"


def test_max_tokens_zero_samples_nothing():
    assert not samples_any(SamplingParams(max_tokens=0)) and samples_any(SamplingParams(max_tokens=1))

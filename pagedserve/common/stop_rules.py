"""When a sample stops, written once: on a stop token (eos unless ignore_eos, or one of
stop_token_ids, once min_tokens are out) or by length (max_tokens out, or the model's context
full); and whether a request samples at all (max_tokens 0: the prompt only).

Plain functions on counts, no state, no threads. Callers: the scheduler core as it takes a
step's tokens (scheduler/core/results.py) and as it plans ahead steps (step_draft.waits_for_result,
StepDraft.record), the record writer on re-admission (scheduler/records.sample_finish_reason),
and the worker's model runner, which samples only for a request that samples at all. It lives
in common because the worker and the scheduler are sibling layers that never import each other.
"""

from __future__ import annotations

from pagedserve.common.sampling_params import SamplingParams


def samples_any(params: SamplingParams) -> bool:
    """False for max_tokens 0: the prefill runs (prompt logprobs), nothing is sampled."""
    return bool(params.max_tokens)


def stops_on(token: int, num_output_tokens: int, params: SamplingParams, eos_token_ids) -> bool:
    """The sample's last token (its num_output_tokens-th) is a stop token that counts now."""
    return num_output_tokens >= params.min_tokens and (
        token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids))


def at_length(num_output_tokens: int, num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> bool:
    """max_tokens are out, or prompt and output fill the model's context."""
    return num_output_tokens >= params.max_tokens or num_prompt_tokens + num_output_tokens >= max_model_len


def finish_reason(outputs: list[int], num_prompt_tokens: int, params: SamplingParams, eos_token_ids,
                  max_model_len: int) -> str:
    """"stop", "length" or "" (not finished) for a sample's output tokens so far."""
    if outputs and stops_on(outputs[-1], len(outputs), params, eos_token_ids):
        return "stop"
    if at_length(len(outputs), num_prompt_tokens, params, max_model_len):
        return "length"
    return ""

"""How many tokens a request is counted for while it is in flight, written once: its prompt
(less what the prefix cache is expected to hold) plus n times its output budget.

A pure function, no state. Callers: the gateway's admission (Admission.reserve, against
--max-tokens-in-flight; an unset max_tokens counts up to the context) and the tokenizer's
replica router (ReplicaRouter.charge, the load it balances on; an unset max_tokens counts a
fixed estimate)."""

from __future__ import annotations


def tokens_in_flight(prompt_tokens: int, n: int, max_tokens: int | None, unset_output: int,
                     cached_tokens: int = 0, max_output: int | None = None) -> int:
    """prompt_tokens - cached_tokens (at least 1) + n (at least 1) x the output budget: max_tokens,
    or unset_output when it is None, capped at max_output when given."""
    out = unset_output if max_tokens is None else max_tokens
    if max_output is not None:
        out = min(out, max_output)
    return max(1, prompt_tokens - cached_tokens) + max(1, n) * out

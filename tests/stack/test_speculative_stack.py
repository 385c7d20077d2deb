"""Speculative decoding through the services (scheduler -> worker over the step link and gRPC):
with --speculative-config the greedy text equals the in-process engine's without it, for a
batch of prompts at once. In-process engines: tests/test_speculative.py."""

from __future__ import annotations

import pytest

from pagedserve.common.sampling_params import SamplingParams
from tiny_models import make_engine

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
PROMPTS = ["one two three one two three one two", "The quick brown fox jumps over the lazy dog. " * 3,
           "a b c d e f g a b c d e f g a b c"]


@pytest.mark.slow
def test_greedy_text_equals_the_engine_without_speculation(tiny_model, launch_stack):
    import openai

    with make_engine(tiny_model, tokenizer=None) as engine:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = engine.generate([engine.tokenizer.encode(p) for p in PROMPTS], params)
        expected = [engine.tokenizer.decode(o[0].token_ids, skip_special_tokens=True) for o in outs]
    stack = launch_stack(tiny_model, speculative_config=SPEC)
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    name = client.models.list().data[0].id
    reply = client.completions.create(model=name, prompt=PROMPTS, temperature=0, max_tokens=24,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == expected

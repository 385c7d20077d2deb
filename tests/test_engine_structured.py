"""Structured outputs in the in-process engine (the worker's matchers and masks, the scheduler's
preemption): a random-weight model samples arbitrary tokens, so only the grammar can make the
text match. Each constrained sample either completes (finish "stop", the text matches in full)
or runs out of tokens (finish "length", the text is a prefix the grammar still accepts)."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import numpy as np
import pytest

from pagedserve.common.sampling_params import SamplingParams, StructuredOutput
from service_stack import tiny_model_with_tokenizer
from tiny_models import make_engine

pytestmark = pytest.mark.slow  # the default model's tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "kind": {"enum": ["cat", "dog", "fish"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    "owner": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["age"], "additionalProperties": False}},
    "required": ["name", "kind", "tags", "owner"], "additionalProperties": False}
REGEX = r"(yes|no)-[0-9]{2}"


@pytest.fixture(scope="module")
def model(default_model_path, tmp_path_factory):
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-structured"), default_model_path)


@pytest.fixture(scope="module")
def engine(model):
    from transformers import AutoTokenizer
    return make_engine(model, tokenizer=AutoTokenizer.from_pretrained(model))


def texts(engine, outs):
    return [(engine.tokenizer.decode(s.token_ids, skip_special_tokens=True), s.finish_reason)
            for samples in outs for s in samples]


def prompts(num, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, int(n)).tolist() for n in rng.integers(5, 40, num)]


def test_regex_and_choice_hold_for_seeded_samples_with_n(engine):
    regex = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16, structured_output=StructuredOutput(regex=REGEX))
    choice = SamplingParams(n=4, temperature=1.0, seed=4, max_tokens=16,
                            structured_output=StructuredOutput(choice=["alpha", "beta", "gamma delta"]))
    free = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8)
    outs = engine.generate(prompts(3, seed=1), [regex, choice, free])
    got = texts(engine, outs)
    for text, reason in got[:4]:
        assert reason == "stop" and re.fullmatch(REGEX, text), text
    for text, reason in got[4:8]:
        assert reason == "stop" and text in ("alpha", "beta", "gamma delta"), text
    assert len(set(t for t, _ in got[:4])) > 1  # the n samples differ: each has its own matcher


def test_json_schema_output_validates(engine):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=120,
                            structured_output=StructuredOutput(json_schema=json.dumps(SCHEMA)))
    for text, reason in texts(engine, engine.generate(prompts(4, seed=2), params)):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


# Two tool calls behind one trigger; the trigger's one token is pushed by logit_bias, so the random
# model writes it at once in free text and again after every call's end.
COUNT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["n"], "additionalProperties": False}
FLAG = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}
TAG = {"structures": [{"begin": "<count>", "schema": COUNT, "end": "</count>"},
                      {"begin": "<flag>", "schema": FLAG, "end": "</flag>"}], "triggers": ["<"]}
CALL = re.compile(r"<(count|flag)>(.*?)</\1>")


def check_tagged(text: str, accepted_prefix) -> int:
    """The calls in a structural-tag text (each body valid under its structure's schema; no trigger
    in the free text between them); the whole text is a prefix the grammar still accepts (the last
    call may be cut by max_tokens). Returns the count."""
    calls = list(CALL.finditer(text))
    for call in calls:
        jsonschema.validate(json.loads(call.group(2)), COUNT if call.group(1) == "count" else FLAG)
    assert "<" not in CALL.sub("", text[:calls[-1].end()] if calls else ""), text
    assert accepted_prefix(text), text
    return len(calls)


# the same calls in xgrammar's format (vLLM's newer form; what each format allows: test_structural_format.py)
FORMAT = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<"], "at_least_one": True,
                                               "tags": [
    {"begin": f"<{name}>", "content": {"type": "json_schema", "json_schema": schema}, "end": f"</{name}>"}
    for name, schema in (("count", COUNT), ("flag", FLAG))]}}


@pytest.mark.parametrize("tag", [TAG, FORMAT], ids=["structures", "format"])
def test_structural_tag_calls_follow_their_schemas(engine, tag):
    import llguidance.hf

    from pagedserve.common import structured_output
    spec = StructuredOutput(structural_tag=structured_output.structural_tag_text(tag))
    trigger = engine.tokenizer.encode("<", add_special_tokens=False)
    assert len(trigger) == 1
    ll = llguidance.hf.from_tokenizer(engine.tokenizer)

    def accepted_prefix(text):
        matcher = llguidance.LLMatcher(ll, structured_output.grammar_text(spec))
        return matcher.consume_tokens(ll.tokenize_str(text)) and not matcher.is_error()

    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=60, logit_bias={trigger[0]: 100.0},
                            structured_output=spec)
    got = texts(engine, engine.generate(prompts(2, seed=6), params))
    counts = [check_tagged(text, accepted_prefix) for text, _ in got]
    assert min(counts) >= 3, got
    assert {m.group(1) for text, _ in got for m in CALL.finditer(text)} == {"count", "flag"}, got
    free = SamplingParams(temperature=1.0, seed=7, max_tokens=12, logit_bias={trigger[0]: 100.0})
    assert texts(engine, engine.generate(prompts(1, seed=6), free))[0][0] == "<" * 12  # the bias alone


def test_a_structural_tag_trigger_that_is_a_special_token_is_that_token(engine):
    """vLLM's rule: a trigger written as a special token of the vocabulary (<|im_start|> here) is matched
    as that token, which a model writes as one id (never as its text: text lexemes exclude special tokens)."""
    from pagedserve.common import structured_output
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    tag = {"structures": [{"begin": "<|im_start|>count", "schema": COUNT, "end": "."}], "triggers": ["<|im_start|>"]}
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, logit_bias={special: 100.0},
                            structured_output=StructuredOutput(structural_tag=structured_output.structural_tag_text(tag)))
    (sample,) = engine.generate(prompts(1, seed=8), params)[0]
    text = engine.tokenizer.decode(sample.token_ids, skip_special_tokens=False)
    calls = re.findall(r"<\|im_start\|>count(\{.*?\})\.", text)
    assert len(calls) >= 3 and sample.token_ids.count(special) >= 3, text
    for call in calls:
        jsonschema.validate(json.loads(call), COUNT)


def test_constraint_holds_across_recompute_preemption(model):
    """A pool too small for the batch preempts requests mid-output; each is re-sent with its tokens
    so far and its matcher is rebuilt from them."""
    from transformers import AutoTokenizer
    tight = make_engine(model, tokenizer=AutoTokenizer.from_pretrained(model), kv_cache_memory=14 * 8192,
                        preemption_mode="recompute")
    regex = r"[a-z]{3}(,[a-z]{3}){7}"  # long enough to be preempted in the middle
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=40, structured_output=StructuredOutput(regex=regex))
    outs = tight.generate(prompts(8, seed=3), params)
    assert tight.stats()["num_preemptions"] > 0
    for text, reason in texts(tight, outs):
        assert reason == "stop" and re.fullmatch(regex, text), text


def test_a_free_batch_builds_no_matcher(engine):
    engine.generate(prompts(2, seed=4), SamplingParams(temperature=0.0, max_tokens=4))
    assert all(s.matcher is None for s in engine.runner.requests.values())


def test_two_tensor_parallel_ranks_give_the_same_constrained_samples(model, engine):
    """Only rank 0 samples (and holds matchers); rank 1 takes its tokens from the broadcast."""
    from transformers import AutoTokenizer
    params = SamplingParams(n=2, temperature=1.0, seed=21, max_tokens=16,
                            structured_output=StructuredOutput(regex=REGEX))
    batch = prompts(2, seed=5)
    one = [[s.token_ids for s in samples] for samples in engine.generate(batch, params)]
    with make_engine(model, tokenizer=AutoTokenizer.from_pretrained(model), tensor_parallel_size=2) as two_ranks:
        two = [[s.token_ids for s in samples] for samples in two_ranks.generate(batch, params)]
    assert two == one
    for text, reason in texts(engine, engine.generate(batch, params)):
        assert reason == "stop" and re.fullmatch(REGEX, text), text


def test_grammars_compile_ahead_and_no_step_waits_for_one(model):
    """The scheduler asks for each grammar when its request arrives and holds the request until the
    worker has compiled it in the background (scheduler/core/grammar_wait.py): no step thread waits
    for a compile, and the constraints hold as before."""
    from transformers import AutoTokenizer
    fresh = make_engine(model, tokenizer=AutoTokenizer.from_pretrained(model))  # nothing compiled yet
    regex = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16, structured_output=StructuredOutput(regex=REGEX))
    schema = SamplingParams(temperature=1.0, seed=6, max_tokens=80,
                            structured_output=StructuredOutput(json_schema=json.dumps(SCHEMA)))
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=8)
    got = texts(fresh, fresh.generate(prompts(4, seed=7), [regex, schema, free, regex]))
    assert fresh.runner.grammars.stalls == 0
    for text, reason in got[:2] + got[4:]:
        assert reason == "stop" and re.fullmatch(REGEX, text), text
    assert got[2][1] == "length" or jsonschema.validate(json.loads(got[2][0]), SCHEMA) is None


def test_a_grammar_not_asked_ahead_compiles_at_its_first_sample(model, tmp_path):
    from pagedserve.worker.structured_output import FAILED, GrammarMatchers
    spec = StructuredOutput(regex=REGEX)
    ahead = GrammarMatchers(model, 32000, (2,))
    ahead.compile_ahead([spec, spec])
    assert compiled(ahead) == [spec.key()] and ahead.take_ready() == []
    ahead.new_matcher(spec, [])
    assert ahead.stalls == 0
    ahead.compile_ahead([spec])  # in the cache already: named at once
    assert ahead.take_ready() == [spec.key()] and ahead.stalls == 0
    inline = GrammarMatchers(model, 32000, (2,))
    assert inline.new_matcher(spec, []) is not FAILED and inline.stalls == 1
    # A grammar that cannot compile (no tokenizer.json) is named all the same; its sequences then end.
    broken = GrammarMatchers(tmp_path, 32000, (2,))
    broken.compile_ahead([spec])
    assert compiled(broken) == [spec.key()] and broken.new_matcher(spec, []) is FAILED


def compiled(grammars, within_s: float = 60.0) -> list[str]:
    """The keys of the first compiles to end (the worker's poll, as a step with no rows waits)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        ready = grammars.take_ready(wait_s=0.5)
        if ready:
            return ready
    return []


def test_a_schema_of_many_optional_properties_holds(engine):
    """800 optional properties: ~3,200 parser items at the first key, past llguidance's default row bound
    (the matcher failed there: '{"' and eos, said "stop"); structured_output.MAX_ITEMS_IN_ROW lets it run."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(800)},
              "required": ["p799"]}  # (else a random model closes it at once)
    params = SamplingParams(n=3, temperature=1.0, seed=8, max_tokens=60,
                            structured_output=StructuredOutput(json_schema=json.dumps(schema)))
    got = texts(engine, engine.generate(prompts(1, seed=9), params))
    for text, reason in got:
        assert reason in ("stop", "length") and re.match(r'\{("p\d+": -?\d+(, )?)*', text), text
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)

"""Structured outputs and logit_bias through every service, driven by the official `openai` client
(and the public gRPC API). The model has random weights, so it samples arbitrary tokens: only the
grammar can make the text match. A sample either completes (finish "stop": it matches in full) or
runs out of max_tokens (finish "length": its text must still be a prefix the grammar accepts,
checked with llguidance itself). The KV pool is small, so the concurrent requests preempt each
other: the constraint must survive the recompute."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagedserve.common import structured_output
from pagedserve.common.sampling_params import StructuredOutput
from service_stack import scheduler_stats

pytestmark = pytest.mark.slow


class Owner(BaseModel):
    age: int = Field(ge=0, le=99)
    verified: bool


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog", "fish"]
    tags: list[Literal["small", "big"]] = Field(max_length=3)
    owner: Owner


MESSAGES = [{"role": "user", "content": "Describe a pet."}]
REGEX = r"(yes|no)-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]


@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    return launch_stack(tiny_model, kv_cache_memory="256KiB", max_num_seqs=16)  # 32 blocks of 16 tokens


@pytest.fixture(scope="module")
def ll_tokenizer(tiny_model):
    import llguidance.hf
    from transformers import AutoTokenizer
    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tiny_model))


def accepted_prefix(ll_tokenizer, spec: StructuredOutput, text: str) -> bool:
    import llguidance
    matcher = llguidance.LLMatcher(ll_tokenizer, structured_output.grammar_text(spec))
    return matcher.consume_tokens(ll_tokenizer.tokenize_str(text)) and not matcher.is_error()


def test_parse_with_a_pydantic_model_streaming_and_not(client, model_name):
    completion = client.chat.completions.parse(model=model_name, messages=MESSAGES, response_format=Pet,
                                               max_tokens=200, temperature=1.0, seed=1)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Pet)
    with client.chat.completions.stream(model=model_name, messages=MESSAGES, response_format=Pet, max_tokens=200,
                                        temperature=1.0, seed=2) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Pet)


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "tags", "owner"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "kind": {"enum": ["cat", "dog", "fish"]},
                         "tags": {"type": "array", "items": {"enum": ["small", "big"]}, "maxItems": 3},
                         "owner": {"$ref": "#/$defs/owner"}},
          "$defs": {"owner": {"type": "object", "additionalProperties": False, "required": ["age", "verified"],
                              "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99},
                                             "verified": {"type": "boolean"}}}}}


def test_json_schema_with_nested_objects_enums_and_arrays_validates(client, model_name):
    schema = SCHEMA  # as OpenAI's strict mode wants it: no additional properties
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}
    for seed in range(3):
        out = client.chat.completions.create(model=model_name, messages=MESSAGES, response_format=response_format,
                                             max_tokens=200, temperature=1.0, seed=seed)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_json_object_parses_or_is_a_json_prefix(client, model_name, ll_tokenizer):
    for seed in range(3):
        out = client.completions.create(model=model_name, prompt="JSON:", max_tokens=48, temperature=1.0, seed=seed,
                                        extra_body={"response_format": {"type": "json_object"}})
        text, reason = out.choices[0].text, out.choices[0].finish_reason
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert reason == "length" and text.startswith("{")
            assert accepted_prefix(ll_tokenizer, StructuredOutput(json_object=True), text), text


def test_regex_and_choice_hold_on_20_seeded_samples_under_preemption(stack, client, model_name):
    preemptions_before = scheduler_stats(stack).num_preemptions

    def regex(seed):  # distinct prompts of ~8 blocks each: 8 at a time do not fit in 32 blocks
        words = " ".join(f"w{seed}x{i}" for i in range(40))
        return client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": words}],
                                              max_tokens=16, temperature=1.0, seed=seed,
                                              extra_body={"structured_outputs": {"regex": REGEX}})

    def choice(seed):  # n > 1: each sample has its own matcher
        return client.completions.create(model=model_name, prompt="Pick one " * (seed + 8), max_tokens=8, n=2,
                                         temperature=1.0, seed=seed, extra_body={"guided_choice": CHOICES})

    with ThreadPoolExecutor(8) as pool:
        regex_outs = list(pool.map(regex, range(20)))
        choice_outs = list(pool.map(choice, range(20)))
    texts = [o.choices[0].message.content for o in regex_outs]
    assert all(re.fullmatch(REGEX, t) for t in texts), texts
    assert len(set(texts)) > 5
    picks = [c.text for o in choice_outs for c in o.choices]
    assert len(picks) == 40 and set(picks) <= set(CHOICES), picks
    assert set(picks) == set(CHOICES)
    assert scheduler_stats(stack).num_preemptions > preemptions_before


def test_guided_json_works_and_an_unsupported_extension_is_400(client, model_name):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=30, temperature=1.0, seed=0,
                                         extra_body={"guided_json": schema})
    assert json.loads(out.choices[0].message.content) in ({"ok": True}, {"ok": False})
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4,
                                       extra_body={"guided_json": schema, "guided_whitespace_pattern": r"\s*"})
    assert "guided_whitespace_pattern" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4,
                                       extra_body={"guided_regex": "(unclosed"})
    assert "guided_regex" in str(info.value) and "unclosed group" in str(info.value)


def test_logit_bias_forces_and_bans_a_token(stack, client, model_name, ll_tokenizer):
    from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

    def greedy_ids(**params) -> list[int]:
        with grpc.insecure_channel(stack.grpc_address) as channel:
            stream = generate_pb2_grpc.GenerationStub(channel).Generate(generate_pb2.GenerateRequest(
                prompt="The weather today", params=common_pb2.SamplingParams(temperature=0, max_tokens=4, **params)),
                timeout=120)
            return [t for m in stream for t in m.token_ids]

    free = greedy_ids()
    banned = greedy_ids(logit_bias={free[0]: -100.0})
    assert free[0] not in banned
    target = 4000 if free[0] != 4000 else 4001
    assert greedy_ids(logit_bias={target: 100.0}) == [target] * 4
    out = client.completions.create(model=model_name, prompt="The weather today", max_tokens=4, temperature=0,
                                    logit_bias={str(target): 100})
    assert out.choices[0].text == ll_tokenizer.decode_str([target] * 4)
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logit_bias={str(target): 100})
    assert chat.choices[0].message.content == ll_tokenizer.decode_str([target] * 4)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4,
                                       logit_bias={"999999": 5})
    assert "logit_bias token id 999999" in str(info.value)


def test_structural_tag_through_chat_and_the_public_grpc(stack, client, model_name, ll_tokenizer):
    """vLLM's response_format {"type": "structural_tag"}: free text until the trigger (its one token
    pushed by logit_bias), then the structure's begin, JSON under its schema, its end. The gRPC API
    gets the same calls in xgrammar's format (vLLM's newer form)."""
    from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    tag = {"structures": [{"begin": "<call>", "schema": schema, "end": "</call>"}], "triggers": ["<"]}
    fmt = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<"], "tags": [
        {"begin": "<call>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</call>"}]}}
    trigger = ll_tokenizer.tokenize_str("<")
    assert len(trigger) == 1
    spec = StructuredOutput(structural_tag=structured_output.structural_tag_text(tag))
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=3,
                                         logit_bias={str(trigger[0]): 100},
                                         response_format={"type": "structural_tag", **tag})
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stream = generate_pb2_grpc.GenerationStub(channel).Generate(generate_pb2.GenerateRequest(
            prompt="Count:", params=common_pb2.SamplingParams(
                temperature=1.0, seed=4, max_tokens=40, logit_bias={trigger[0]: 100.0},
                structured_output=common_pb2.StructuredOutput(structural_tag=json.dumps(fmt)))), timeout=120)
        grpc_text = "".join(m.text for m in stream)
    for text in (out.choices[0].message.content, grpc_text):
        calls = re.findall(r"<call>(.*?)</call>", text)
        assert len(calls) >= 3 and all(jsonschema.validate(json.loads(c), schema) is None for c in calls), text
        assert accepted_prefix(ll_tokenizer, spec, text), text


def test_public_grpc_refuses_a_bad_grammar(stack):
    from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
    params = common_pb2.SamplingParams(max_tokens=4, structured_output=common_pb2.StructuredOutput(regex="(ab"))
    with grpc.insecure_channel(stack.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(generate_pb2_grpc.GenerationStub(channel).Generate(
                generate_pb2.GenerateRequest(prompt="x", params=params), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in info.value.details()

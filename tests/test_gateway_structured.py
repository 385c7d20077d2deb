"""The gateway's mapping of structured-output fields, logit_bias and unsupported extension fields
onto the GenerateRequest, and the 400s it answers before anything is sent downstream."""

from __future__ import annotations

import json

import pytest

from pagedserve.common import wire
from pagedserve.gateway.protocol import ChatCompletionRequest, CompletionRequest, RequestError, chat_to_generate, \
    completion_to_generate

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# vLLM's structural tag (its response_format form and, as JSON, structured_outputs.structural_tag)
TAG = {"structures": [{"begin": "<function=add>", "schema": SCHEMA, "end": "</function>"},
                      {"begin": "<function=now>", "end": "</function>"}], "triggers": ["<function="]}
TAG_HELD = {"structures": [{"begin": "<function=add>", "schema": SCHEMA, "end": "</function>"},
                           {"begin": "<function=now>", "schema": {}, "end": "</function>"}], "triggers": ["<function="]}
# the same calls in xgrammar's format (vLLM's newer form), and as it is held (the defaults filled in)
FORMAT = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<function="], "tags": [
    {"begin": "<function=add>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</function>"}]}}
FORMAT_HELD = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "tags": [{"type": "tag", "begin": "<function=add>", "content": {
        "type": "json_schema", "json_schema": SCHEMA}, "end": "</function>"}],
    "at_least_one": False, "stop_after_first": False, "triggers": ["<function="]}}


def chat(**fields):
    return chat_to_generate(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}))


def completion(**fields):
    return completion_to_generate(CompletionRequest.model_validate({"prompt": "hi", **fields}))


def refused(build, **fields) -> RequestError:
    with pytest.raises(RequestError) as info:
        build(**fields)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("build", [chat, completion])
@pytest.mark.parametrize("fields, expect", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     {"json_schema": SCHEMA}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": SCHEMA}),
    ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
    ({"structured_outputs": {"choice": ["a", "b"]}}, {"choice": ["a", "b"]}),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, {"grammar": 'root ::= "x"'}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json_schema": SCHEMA}),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "auto"}, {"json_schema": SCHEMA}),
    ({"guided_regex": "a|b"}, {"regex": "a|b"}),
    ({"guided_choice": ["x", "y"]}, {"choice": ["x", "y"]}),
    ({"guided_grammar": 'start: "x"'}, {"grammar": 'start: "x"'}),
    ({"response_format": {"type": "structural_tag", **TAG}}, {"structural_tag": TAG_HELD}),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG)}}, {"structural_tag": TAG_HELD}),
    ({"structural_tag": json.dumps(TAG)}, {"structural_tag": TAG_HELD}),
    ({"response_format": FORMAT}, {"structural_tag": FORMAT_HELD}),
    ({"structured_outputs": {"structural_tag": json.dumps(FORMAT)}}, {"structural_tag": FORMAT_HELD}),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True, "disable_fallback": True}},
     {"json_schema": SCHEMA}),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"properties": {
        "type": "object", "properties": {}}}, "additionalProperties": True}, "disable_additional_properties": True}},
     {"json_schema": {"type": "object", "properties": {"properties": {
         "type": "object", "properties": {}, "additionalProperties": False}}, "additionalProperties": True}}),
])
def test_constraints_become_one_structured_output(build, fields, expect):
    params = wire.params_from_proto(build(**fields).params)
    spec = params.structured_output
    assert spec is not None and len(spec.kinds()) == 1
    for name, value in expect.items():
        got = getattr(spec, name)
        assert (json.loads(got) if name in ("json_schema", "structural_tag") else got) == value


def test_no_constraint_leaves_the_field_unset():
    assert not chat().params.HasField("structured_output")
    assert not chat(response_format={"type": "text"}).params.HasField("structured_output")


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "bogus"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "unknown name"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " *"}}, "structured_outputs", "whitespace_pattern"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}}, "response_format",
     "structural_tag.format: a triggered_tags format needs tags, triggers"),
    ({"structured_outputs": {"structural_tag": {"format": {"type": "qwen_xml_parameter", "json_schema": {}}}}},
     "structured_outputs", "qwen_xml_parameter is not supported"),
    ({"response_format": {"type": "structural_tag", **TAG, "triggers": ["<tool>"]}}, "response_format",
     "structures[0].begin '<function=add>' does not start with any of the triggers"),
    ({"response_format": {"type": "structural_tag", **TAG, "triggers": []}}, "response_format",
     "triggers must be a non-empty list"),
    ({"structured_outputs": {"structural_tag": '{"structures": [], "triggers": ["<"]}'}}, "structured_outputs",
     "structures must be a non-empty list"),
    ({"structural_tag": '{"structures": [{"begin": "<a>", "schema": {"type": "bogus"}, "end": ""}], '
                        '"triggers": ["<"]}'}, "structural_tag", "bogus"),
    ({"structural_tag": "{oops"}, "structural_tag", "not valid JSON"),
    ({"guided_whitespace_pattern": " +"}, "guided_whitespace_pattern", "not supported"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "not supported"),
    ({"early_stopping": True}, "early_stopping", "not supported"),
    ({"logits_processors": ["my.Processor"]}, "logits_processors", "not supported"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    ({"bad_words": ["ok", "\t"]}, "bad_words", "bad_words[1] must be a word"),
])
def test_bad_constraints_and_unsupported_extensions_are_400_naming_the_field(fields, param, words):
    error = refused(chat, **fields)
    assert error.param == param and words in error.message, error.message


@pytest.mark.parametrize("fields", [{"guided_regex": "a+"}, {"guided_json": SCHEMA}, {"guided_choice": ["a"]},
                                    {"structural_tag": json.dumps(TAG)}, {"structured_outputs": {"regex": "a"}},
                                    {"response_format": {"type": "structural_tag", **TAG}}])
def test_a_beam_search_refuses_every_structured_output(fields):
    """Each beam step is a one-token request over the beam's text: a grammar there would restart
    at every step, so a constraint with use_beam_search is a 400 naming it."""
    from pagedserve.gateway.beam_call import check_beam_request
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                 "use_beam_search": True, **fields})
    with pytest.raises(RequestError) as info:
        check_beam_request(body, 20)
    assert info.value.param == next(iter(fields)), info.value.message


def test_the_beam_width_is_bounded_by_max_logprobs():
    from pagedserve.gateway.beam_call import check_beam_request
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "n": 12,
                                                 "use_beam_search": True})
    with pytest.raises(RequestError) as info:
        check_beam_request(body, 20)
    assert info.value.param == "n" and "at most 10 beams" in info.value.message
    assert check_beam_request(body, 24).beam_width == 12


def test_off_values_of_unsupported_extensions_and_unknown_fields_pass():
    chat(use_beam_search=False, guided_whitespace_pattern=None, spaces_between_special_tokens=True,
         some_future_openai_field={"x": 1})


def test_logit_bias_is_clipped_to_100():
    params = completion(logit_bias={"5": 250, "7": -3.5}).params
    assert dict(params.logit_bias) == {5: 100.0, 7: -3.5}


def test_params_round_trip_through_the_record_json_and_the_proto():
    """The scheduler stores params as JSON (Redis records) and re-creates them on resume."""
    from pagedserve.common.sampling_params import SamplingParams

    params = wire.params_from_proto(chat(guided_choice=["x", "y"], logit_bias={"5": -2}).params)
    again = SamplingParams(**json.loads(json.dumps(params.to_dict())))
    assert again == params and again.logit_bias == {5: -2.0} and again.structured_output.choice == ["x", "y"]
    assert wire.params_from_proto(wire.params_to_proto(again)) == params

"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) through every service, driven
by the official `openai` client's responses.create / .stream. A tiny model made to write a thinking
block ("hmm ok</think>", service_stack.bigram_chain_model) answers after it under a structured_outputs
regex (vLLM's extension, in extra_body; it applies after the reasoning), which --reasoning-parser
deepseek_r1 splits into a reasoning item and a message; a text.format json_schema and a forced
function tool are enforced by structured outputs, after the reasoning too. Stored responses are
the caller's: another API key gets 404, and store: false keeps nothing."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from service_stack import bigram_chain_model
from test_tools_stack import TEMPLATE, WEATHER

pytestmark = pytest.mark.slow

K1, K2 = "sk-responses-one", "sk-responses-two"
THOUGHT = r"[a-z]{1,8}( [a-z]{1,8}){0,2}"
ANSWER = r"(yes|no)-[0-9]{2}"
REGEX = ANSWER  # what follows the thinking block
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer",
                                                                                      "minimum": 0, "maximum": 20}},
          "required": ["kind", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def stack(default_model_path, tmp_path_factory, launch_stack):
    folder = tmp_path_factory.mktemp("chain-responses")
    bigram_chain_model(folder, default_model_path, "hmm ok</think>", "<|im_start|>assistant\n")
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return launch_stack(folder, api_key=[K1, K2], reasoning_parser="deepseek_r1", tool_call_parser="hermes",
                        max_num_seqs=8)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=K1, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def other(stack):
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=K2, max_retries=0, timeout=300)


def test_reasoning_and_text_streamed_and_not_then_retrieved(client, other, model_name):
    kwargs = dict(model=model_name, input="Yes or no?", instructions="Think first.", max_output_tokens=60,
                  temperature=1.0, extra_body={"seed": 7, "structured_outputs": {"regex": REGEX}})
    response = client.responses.create(**kwargs)
    assert response.status == "completed" and response.id.startswith("resp_")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and re.fullmatch(THOUGHT, reasoning.content[0].text)
    assert message.type == "message" and re.fullmatch(ANSWER, response.output_text)
    assert response.usage.output_tokens > 3 and response.usage.input_tokens > 5
    events = []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_response()
    assert (final.output_text, final.output[0].content[0].text) == (response.output_text, reasoning.content[0].text)
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
    assert "response.reasoning_text.delta" in events and "response.output_text.delta" in events
    assert events.index("response.output_text.done") < events.index("response.completed")
    got = client.responses.retrieve(response.id)
    assert (got.id, got.output_text) == (response.id, response.output_text)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(response.id)  # another key's: as if it did not exist
    client.responses.delete(response.id)
    for gone in (lambda: client.responses.retrieve(response.id), lambda: client.responses.delete(response.id),
                 lambda: client.responses.create(model=model_name, previous_response_id=response.id, input="more")):
        with pytest.raises(openai.NotFoundError):
            gone()


def test_json_schema_format(client, model_name):
    response = client.responses.create(
        model=model_name, input="A pet?", max_output_tokens=80, temperature=1.0, extra_body={"seed": 1},
        text={"format": {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}})
    assert response.status == "completed", response.output
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_function_call_then_its_output_with_previous_response_id(client, other, model_name):
    first = client.responses.create(model=model_name, input="Weather in Paris?", tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                    temperature=1.0, extra_body={"seed": 3})
    reasoning, call = first.output  # the thinking block, then the call the grammar forced after it
    assert reasoning.type == "reasoning"
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow = [{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}]
    second = client.responses.create(model=model_name, previous_response_id=first.id, input=follow, tools=TOOLS,
                                     tool_choice="none", max_output_tokens=8)
    assert second.previous_response_id == first.id and second.output[-1].type == "message"
    # The conversation was carried: the second prompt holds the question, the call and its output.
    alone = client.responses.create(model=model_name, input="Weather in Paris?", tools=TOOLS, tool_choice="none",
                                    max_output_tokens=1)
    assert second.usage.input_tokens > alone.usage.input_tokens + 10
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=model_name, previous_response_id=first.id, input=follow, max_output_tokens=4)
    unstored = client.responses.create(model=model_name, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model=model_name, input="hi", max_output_tokens=2, background=True)

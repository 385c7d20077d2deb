"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through every service,
driven by the official `anthropic` client with its x-api-key header. The tiny model's weights are
random, so a structured_outputs regex (vLLM's extension, passed as extra_body, like temperature, which
this client version no longer takes as an argument) makes its text known
where a test needs it; a forced tool_choice makes it call a tool (structured outputs), and the
call's result goes back as a tool_result. Streamed and whole answers must agree (same seed)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from test_tools_stack import TEMPLATE, WEATHER

pytestmark = pytest.mark.slow

KEY = "sk-anthropic-test"
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
REGEX = r"(yes|no)-[0-9]{2} STOP [a-z]{3}"


@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    (tiny_model / "chat_template.jinja").write_text(TEMPLATE)
    return launch_stack(tiny_model, api_key=[KEY], tool_call_parser="hermes", max_num_seqs=8)


@pytest.fixture(scope="module")
def claude(stack):
    import anthropic
    return anthropic.Anthropic(base_url=stack.http_url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(claude):
    import openai
    return openai.OpenAI(base_url=claude.base_url.__str__() + "/v1", api_key=KEY).models.list().data[0].id


def test_text_stop_sequence_and_usage_streamed_and_not(claude, model):
    kwargs = dict(model=model, max_tokens=30, system="Answer briefly.", messages=ASK, stop_sequences=["STOP"],
                  extra_body={"temperature": 1.0, "seed": 5, "structured_outputs": {"regex": REGEX}})
    message = claude.messages.create(**kwargs)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and re.fullmatch(r"(yes|no)-[0-9]{2} ", block.text), block.text
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "STOP")
    counted = claude.messages.count_tokens(model=model, system="Answer briefly.", messages=ASK)
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == counted.input_tokens > 5
    assert 0 < message.usage.output_tokens <= 30
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "STOP")
    assert final.usage.output_tokens == message.usage.output_tokens


def test_forced_tool_use_then_its_result(claude, model):
    message = claude.messages.create(model=model, max_tokens=60, messages=ASK, tools=TOOLS,
                                     tool_choice={"type": "tool", "name": "get_weather"},
                                     extra_body={"temperature": 1.0, "seed": 2})
    [call] = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and message.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER)
    with claude.messages.stream(model=model, max_tokens=60, messages=ASK, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body={"temperature": 1.0, "seed": 2}) as stream:
        final = stream.get_final_message()
    assert (final.content[0].name, final.content[0].input) == ("get_weather", call.input)
    history = [*ASK, {"role": "assistant", "content": [call.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}]}]
    after = claude.messages.create(model=model, max_tokens=5, messages=history, tools=TOOLS,
                                   tool_choice={"type": "none"})
    assert after.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in after.content)
    assert claude.messages.count_tokens(model=model, messages=history, tools=TOOLS).input_tokens > \
        claude.messages.count_tokens(model=model, messages=ASK).input_tokens


def test_event_sequence_and_errors_in_anthropics_shape(stack, claude, model):
    import anthropic
    body = {"model": model, "max_tokens": 8, "messages": ASK, "stream": True}
    with httpx.stream("POST", stack.http_url + "/v1/messages", json=body, headers={"x-api-key": KEY},
                      timeout=300) as response:
        names = [line[len("event: "):] for line in response.iter_lines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    blocks = names[1:-2]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    assert set(blocks[1:-1]) == {"content_block_delta"}
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=stack.http_url, api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=4, messages=ASK)
    assert err.value.body["error"]["type"] == "authentication_error"
    bad = httpx.post(stack.http_url + "/v1/messages", json={"model": model, "messages": ASK},
                     headers={"x-api-key": KEY}, timeout=60)
    assert bad.status_code == 400
    assert bad.json()["type"] == "error" and bad.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.json()["error"]["message"]
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]
    with pytest.raises(anthropic.BadRequestError, match="image"):
        claude.messages.create(model=model, max_tokens=4, messages=image)
    assert json.loads(httpx.post(stack.http_url + "/v1/messages/count_tokens", content=b"{",
                                 headers={"x-api-key": KEY}).text)["error"]["type"] == "invalid_request_error"

"""The Responses API's mapping (pagedserve/gateway/responses_api.py, responses_output.py) without services: input items
onto chat messages, refused fields, a chat answer onto output items and the conversation that a
previous_response_id continues, and a chunk stream onto the typed events in order."""

from __future__ import annotations

import json

import pytest

from pagedserve.gateway.protocol import RequestError
from pagedserve.gateway.responses_api import to_chat
from pagedserve.gateway.responses_output import EventBuilder, Shell, output_messages, response_output


def test_input_items_onto_the_chat_request():
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"}]
    chat, conversation = to_chat({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "tool_choice": {"type": "function",
                                                                                         "name": "f"},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "done"}]}, history)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user", "assistant", "tool"]
    assert [c["id"] for c in chat.messages[4].tool_calls] == ["c1", "c2"]
    assert conversation[:2] == history and len(conversation) == 5  # the instructions are not carried
    assert chat.max_tokens == 9 and chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": "x", "truncation": "auto"}, "truncation"),
    ({"model": "m", "input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": [{"type": "input_image"}]}, "input"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}}, "text"),
])
def test_refused_fields_are_named(body, field):
    with pytest.raises(RequestError) as err:
        to_chat(body, [])
    assert err.value.status == 400 and err.value.param == field


def test_answer_onto_output_items_and_the_next_turn():
    chat = {"choices": [{"finish_reason": "tool_calls", "message": {
        "reasoning_content": "hm", "content": "calling",
        "tool_calls": [{"id": "call_1", "function": {"name": "f", "arguments": '{"a": 1}'}}]}}]}
    output, status = response_output(chat)
    assert status == "completed" and [i["type"] for i in output] == ["reasoning", "message", "function_call"]
    assert output[2]["call_id"] == "call_1" and output[1]["content"][0]["text"] == "calling"
    assert output_messages(output) == [{"role": "assistant", "content": "calling", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    assert response_output({"choices": [{"finish_reason": "length", "message": {"content": "x"}}]})[1] == "incomplete"


def test_chunks_onto_typed_events():
    builder = EventBuilder(Shell({"model": "m", "input": "x"}, "resp_1", "m"))
    chunks = [{"delta": {"reasoning_content": "hm"}}, {"delta": {"content": "a"}}, {"delta": {"content": "b"}},
              {"delta": {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]}},
              {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, "finish_reason": "tool_calls"}]
    out = builder.start() + [e for c in chunks for e in builder.chunk({"choices": [c]})]
    finish, final = builder.finish({"prompt_tokens": 3, "completion_tokens": 4})
    events = [json.loads(e.split("\n")[1][len("data: "):]) for e in out + finish]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert final["output"][1]["content"][0]["text"] == "ab" and final["output"][2]["arguments"] == "{}"
    assert final["usage"]["total_tokens"] == 7 and final["status"] == "completed"

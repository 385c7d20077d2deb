"""The Messages API's mapping (pagedserve/gateway/anthropic_api.py) without services: a body onto
the chat request, a chat answer back onto a message, and a chunk stream onto Anthropic's events
with a stop sequence split across chunks held back and stripped."""

from __future__ import annotations

import json

import pytest

from pagedserve.gateway.anthropic_api import EventBuilder, message_body, to_chat
from pagedserve.gateway.protocol import RequestError


def test_body_onto_the_chat_request():
    chat = to_chat({"model": "m", "max_tokens": 7, "system": [{"type": "text", "text": "Be brief."}],
                    "stop_sequences": ["END"], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                    "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                    "messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": [
                                     {"type": "thinking", "thinking": "hm", "signature": ""},
                                     {"type": "text", "text": "calling"},
                                     {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                                 {"role": "user", "content": [
                                     {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text",
                                                                                               "text": "ok"}]},
                                     {"type": "text", "text": "thanks"}]}]})
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "hi"), ("assistant", "calling"), ("tool", "ok"), ("user", "thanks")]
    assert chat.messages[2].tool_calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert chat.messages[3].tool_call_id == "t1"
    assert (chat.max_tokens, chat.stop, chat.include_stop_str_in_output) == (7, ["END"], True)
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", False)
    assert chat.tools[0]["function"]["parameters"] == {"type": "object"}
    thinking = to_chat({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}],
                        "thinking": {"type": "disabled"}, "metadata": {"user_id": "u"}})
    assert thinking.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 4, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]},
     "stop_sequences"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "x"}},
     "tool_choice"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "mcp_servers": []},
     "mcp_servers"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
])
def test_bad_bodies_name_the_field(body, field):
    with pytest.raises(RequestError) as err:
        to_chat(body)
    assert err.value.status == 400 and err.value.param == field


def chat_answer(message: dict, reason: str) -> dict:
    return {"model": "m", "choices": [{"message": message, "finish_reason": reason}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 3}}}


def test_answer_onto_a_message():
    body = message_body(chat_answer({"content": "yes END"}, "stop"), ["END"], "msg_1")
    assert body["content"] == [{"type": "text", "text": "yes "}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")
    assert body["usage"] == {"input_tokens": 7, "output_tokens": 4, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 3}
    calls = message_body(chat_answer({"content": None, "reasoning_content": "think", "tool_calls": [
        {"id": "call_1", "function": {"name": "f", "arguments": '{"a": 1}'}}]}, "tool_calls"), [], "msg_2")
    assert calls["content"] == [{"type": "thinking", "thinking": "think", "signature": ""},
                                {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}]
    assert calls["stop_reason"] == "tool_use"
    assert message_body(chat_answer({"content": "x"}, "length"), [], "m")["stop_reason"] == "max_tokens"


def events(strings: list[str]) -> list[tuple[str, dict]]:
    out = []
    for s in strings:
        name, data = s.split("\n")[:2]
        out.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return out


def test_chunks_onto_events_with_a_held_stop_sequence():
    builder = EventBuilder("msg_1", "m", 10, ["STOP"])
    chunks = [{"delta": {"reasoning_content": "hm"}}, {"delta": {"content": "yes S"}}, {"delta": {"content": "TO"}},
              {"delta": {"content": "P"}, "finish_reason": "stop"}]
    out = events(builder.start() + [e for c in chunks for e in builder.chunk({"choices": [c]})]
                 + builder.finish({"prompt_tokens": 10, "completion_tokens": 5}))
    names = [n for n, _ in out]
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    assert out[1][1]["content_block"]["type"] == "thinking" and out[4][1]["index"] == 1
    assert out[5][1]["delta"] == {"type": "text_delta", "text": "yes "}  # "S", "STO", "STOP" held, then stripped
    delta = out[7][1]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}
    assert delta["usage"]["output_tokens"] == 5

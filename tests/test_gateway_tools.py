"""Tool calling's pure parts: tools/tool_choice/history -> GenerateRequest (gateway/tools.py), the
template inputs the tokenizer builds from it (tokenizer/chat_render.py), and the response shapes
(message.tool_calls, streamed delta.tool_calls, finish_reason) built by responses.py."""

from __future__ import annotations

import json

import pytest

from pagedserve.gateway.protocol import ChatCompletionRequest, RequestError, chat_to_generate
from pagedserve.gateway.responses import ChunkBuilder, Collector
from pagedserve.gateway.tools import ToolOutput, chat_tools
from pagedserve.tokenizer.chat_render import template_messages, template_tools
from pagedserve.v1 import generate_pb2

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "now"}}]
USER = [{"role": "user", "content": "hi"}]


def request(parser: str | None = "hermes", **kw):
    req = ChatCompletionRequest(**{"messages": USER, **kw})
    gen = chat_to_generate(req)
    return gen, chat_tools(req, gen, parser)


def refused(**kw) -> RequestError:
    with pytest.raises(RequestError) as info:
        request(**kw)
    return info.value


def test_tool_choice_modes():
    gen, out = request(tools=TOOLS)  # auto by default
    assert out == ToolOutput(parser="hermes") and [t.name for t in gen.chat.tools] == ["get_weather", "now"]
    assert json.loads(gen.chat.tools[0].parameters_json) == PARAMS and gen.chat.tools[1].parameters_json == ""
    assert not gen.params.HasField("structured_output")
    gen, out = request(tools=TOOLS, tool_choice="none")
    assert out is None and not gen.chat.tools
    gen, out = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert out == ToolOutput(function="get_weather") and json.loads(gen.params.structured_output.json_schema) == PARAMS
    gen, out = request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(gen.params.structured_output.json_schema)
    assert out == ToolOutput(required=True, max_calls=1) and (schema["type"], schema["maxItems"]) == ("array", 1)
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [["get_weather"], ["now"]]
    gen, _ = request(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                     tool_choice={"type": "function", "function": {"name": "f"}})
    assert json.loads(gen.params.structured_output.json_schema) == {"type": "object"}
    gen, out = request(parser=None)  # no tools: plain chat, whatever the server's parser
    assert out is None and not gen.chat.tools


def test_bad_tool_requests():
    assert refused(parser=None, tools=TOOLS).param == "tool_choice"  # auto needs --tool-call-parser
    exc = refused(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "'nope'" in exc.message and exc.param == "tool_choice"
    assert refused(tools=TOOLS, tool_choice="sometimes").param == "tool_choice"
    assert refused(tool_choice="auto").param == "tool_choice"  # no tools
    for bad in ({"type": "function"}, {"type": "function", "function": {"name": ""}}, "get_weather",
                {"type": "function", "function": {"name": "f", "description": 3}},
                {"type": "function", "function": {"name": "f", "parameters": "{}"}}):
        assert refused(tools=[bad]).param == "tools", bad
    assert "twice" in refused(tools=[TOOLS[0], TOOLS[0]]).message
    exc = refused(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert "response_format" in exc.message


def test_history_reaches_the_template_as_hf_templates_expect():
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
        {"role": "user", "content": "thanks", "name": "bob"}]
    gen, _ = request(messages=messages, tools=TOOLS)
    rendered, _ = template_messages(gen.chat)
    assert rendered[0] == {"role": "user", "content": "hi"}  # plain messages keep their old shape
    assert rendered[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "P"}}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "not json"}}]
    assert rendered[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"}
    assert rendered[3] == {"role": "user", "content": "thanks"}
    assert template_tools(gen.chat) == [
        {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": PARAMS}},
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    assert template_tools(generate_pb2.ChatMessages()) is None
    assert "tool_call_id" in refused(messages=[{"role": "tool", "content": "x"}]).message
    assert "assistant" in refused(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]).message
    assert refused(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]).param == "messages"


def responses(texts: list[str], finish: str = "stop") -> list[generate_pb2.GenerateResponse]:
    out = [generate_pb2.GenerateResponse(accepted=True)]
    out += [generate_pb2.GenerateResponse(text=t, token_ids=[1]) for t in texts]
    out[-1].finish_reason = finish
    return out


TEXTS = ["Sure.", " <tool_", 'call>{"name": "get_weather", ', '"arguments": {"city"', ': "Paris"}}</tool_call>']


def test_non_streamed_message_and_finish_reason():
    collector = Collector(1)
    for msg in responses(TEXTS):
        collector.add(msg)
    choice = collector.chat("id", "m", 0, False, ToolOutput(parser="hermes"))["choices"][0]
    [call] = choice["message"].pop("tool_calls")
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["message"] == {"role": "assistant", "content": "Sure."} and choice["finish_reason"] == "tool_calls"
    # No tools: the answer's bytes are as before (no tool_calls key); cut off by length: "length".
    plain = Collector(1)
    for msg in responses(TEXTS, "length"):
        plain.add(msg)
    assert "tool_calls" not in plain.chat("id", "m", 0, False)["choices"][0]["message"]
    assert plain.chat("id", "m", 0, False, ToolOutput(parser="hermes"))["choices"][0]["finish_reason"] == "length"


def test_streamed_chunks_as_openai_sends_them():
    builder = ChunkBuilder(True, "id", "m", 0, 1, False, tools=ToolOutput(parser="hermes"))
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
              for msg in responses(TEXTS) for c in builder.add(msg)]
    assert deltas[0] == ({"role": "assistant", "content": ""}, None)
    assert deltas[1] == ({"content": "Sure."}, None)
    first = deltas[2][0]["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [d["tool_calls"][0] for d, _ in deltas[3:]]
    assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in fragments)
    assert "".join(f["function"]["arguments"] for f in fragments) == '{"city": "Paris"}'
    assert deltas[-1][1] == "tool_calls" and all(r is None for _, r in deltas[:-1])


def test_a_resumed_stream_catches_up_without_resending():
    """A resumed stream's builder reads the text the client already had (skip_text) and sends only
    what follows, in the same shape: the client's pieces add up to the whole call."""
    msgs = responses(TEXTS)
    first = ChunkBuilder(True, "id", "m", 0, 1, False, tools=ToolOutput(parser="hermes"))
    before = [c["choices"][0]["delta"] for msg in msgs[:4] for c in first.add(msg)]
    resumed = ChunkBuilder(True, "id", "m", 0, 1, False, tools=ToolOutput(parser="hermes"))
    for msg in msgs[1:4]:
        resumed.skip_text(msg.index, msg.text)
    after = [c["choices"][0] for msg in msgs[4:] for c in resumed.add(msg)]
    calls = [d["tool_calls"][0] for d in before + [c["delta"] for c in after] if "tool_calls" in d]
    assert sum("id" in c for c in calls) == 1 and after[-1]["finish_reason"] == "tool_calls"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert all("content" not in c["delta"] for c in after)

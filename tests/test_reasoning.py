"""Reasoning parsers (pagedserve/gateway/reasoning.py) and the chat shapes they give: the split of
a text whole and in every streamed split, message.reasoning_content and delta.reasoning_content,
tool calls read from the content after the reasoning only, and thinking turned off per request."""

from __future__ import annotations

import pytest

from pagedserve.common.settings import setting
from pagedserve.gateway.reasoning import PARSERS, ReasoningSplitter, request_parser, split, structured_end
from pagedserve.gateway.responses import ChunkBuilder, Collector, Reasoning
from pagedserve.gateway.tools import ToolOutput
from pagedserve.v1 import generate_pb2
from test_tool_parsers import splits

CASES = [
    # (parser, text, reasoning, content)
    ("deepseek_r1", "<think>plan it</think>The answer.", "plan it", "The answer."),
    ("deepseek_r1", "plan it</think>\n\nThe answer.", "plan it", "\n\nThe answer."),  # <think> in the prompt
    ("deepseek_r1", "still thinking <", "still thinking <", None),  # never ended: reasoning only
    ("deepseek_r1", "<thi", "<thi", None),
    ("deepseek_r1", "</think>x", None, "x"),
    ("deepseek_r1", "a</thin", "a</thin", None),
    ("qwen3", "<think>plan</think>The answer.", "plan", "The answer."),
    ("qwen3", "The answer, no thinking.", None, "The answer, no thinking."),  # enable_thinking false
    ("qwen3", "<think>unfinished", "unfinished", None),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "a</think>b", None, "a</think>b"),  # no opening tag: all content
    ("granite", "Here is my thought process:\nplan it\nHere is my response:\nThe answer.", "\nplan it\n",
     "\nThe answer."),
    ("granite", "Here's my thought process: a Here's my response: b", " a ", " b"),  # quantized models' variant
    ("granite", "Here's my thought process: a Here is my response: b", " a ", " b"),
    ("granite", "Here is my thought process: Here is a plan. Here's the rest. Here is my response: ok",
     " Here is a plan. Here's the rest. ", " ok"),  # "Here" in the reasoning is no marker
    ("granite", "Here is my thought process: unfinished Here is my resp", " unfinished Here is my resp", None),
    ("granite", "Here is my thought process:x", "x", None),
    ("granite", "The answer, no thinking.", None, "The answer, no thinking."),  # thinking off (the default)
    ("granite", "Here is the answer.", None, "Here is the answer."),
    ("granite", "Here is my", None, "Here is my"),
    ("granite", "So. Here is my thought process: a Here is my response: b", None,
     "So. Here is my thought process: a Here is my response: b"),  # the opening only opens the output
    ("granite", "a Here is my response: b", None, "a Here is my response: b"),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_split_whole_and_in_every_split(parser, text, reasoning, content):
    assert split(parser, text) == (reasoning, content)
    for pieces in splits(text):
        splitter = ReasoningSplitter(parser)
        got = [splitter.feed(p) for p in pieces] + [splitter.finish()]
        assert ("".join(r for r, _ in got) or None, "".join(c for _, c in got) or None) == (reasoning, content), \
            pieces


def test_thinking_off_per_request_and_the_flag():
    assert request_parser("qwen3", None) == "qwen3"
    assert request_parser("qwen3", {"enable_thinking": False}) is None
    assert request_parser("deepseek_r1", {"thinking": False}) is None
    assert request_parser(None, {"enable_thinking": True}) is None
    assert request_parser("granite", {"thinking": False}) is None
    assert request_parser("granite", {"thinking": True}) == "granite"
    for service in ("gateway", "serve"):
        assert set(setting(service, "reasoning_parser").choices) == set(PARSERS)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningSplitter("nope")


def test_structured_outputs_follow_the_reasoning_except_granites():
    """vLLM's: a constraint applies after </think>; granite's markers are text a model with thinking
    off (its default) never writes, so there the constraint holds from the first token."""
    assert structured_end("deepseek_r1") == structured_end("qwen3") == "</think>"
    assert structured_end("granite") == ""


def responses(texts: list[str], finish: str = "stop") -> list[generate_pb2.GenerateResponse]:
    out = [generate_pb2.GenerateResponse(accepted=True)]
    out += [generate_pb2.GenerateResponse(text=t, token_ids=[1]) for t in texts]
    out[-1].finish_reason = finish
    return out


THOUGHT = ["<thi", "nk>Weather? Maybe <tool_call>{\"name\": \"x\"}</tool_call> no.</th", "ink>Sure.",
           ' <tool_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}</tool_call>']
THOUGHT_TEXT = 'Weather? Maybe <tool_call>{"name": "x"}</tool_call> no.'


def test_message_reasoning_and_tool_calls_after_it():
    collector = Collector(1)
    for msg in responses(THOUGHT):
        collector.add(msg)
    choice = collector.chat("id", "m", 0, False, ToolOutput(parser="hermes"), Reasoning("deepseek_r1"))["choices"][0]
    message = choice["message"]
    [call] = message.pop("tool_calls")  # the call in the reasoning is not one
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert message == {"role": "assistant", "content": "Sure.", "reasoning_content": THOUGHT_TEXT}
    assert choice["finish_reason"] == "tool_calls"
    # Thinking off for the request: the key is there, null, and the text is all content.
    plain = Collector(1)
    for msg in responses(["<think>a</think>b"]):
        plain.add(msg)
    assert plain.chat("id", "m", 0, False, None, Reasoning(None))["choices"][0]["message"] == \
        {"role": "assistant", "content": "<think>a</think>b", "reasoning_content": None}
    # Reasoning only (cut off by length): content null.
    assert plain.chat("id", "m", 0, False, None, Reasoning("deepseek_r1"))["choices"][0]["message"] == \
        {"role": "assistant", "content": "b", "reasoning_content": "a"}
    cut = Collector(1)
    for msg in responses(["<think>still"], "length"):
        cut.add(msg)
    assert cut.chat("id", "m", 0, False, None, Reasoning("deepseek_r1"))["choices"][0]["message"] == \
        {"role": "assistant", "content": None, "reasoning_content": "still"}


def test_streamed_deltas_split_the_same_way():
    builder = ChunkBuilder(True, "id", "m", 0, 1, False, tools=ToolOutput(parser="hermes"),
                           reasoning=Reasoning("deepseek_r1"))
    chunks = [c for msg in responses(THOUGHT) for c in builder.add(msg)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT_TEXT
    assert "".join(d.get("content") or "" for d in deltas[1:]) == "Sure."
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert all(set(d) <= {"reasoning_content", "content", "tool_calls"} for d in deltas[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # No parser: the deltas are as before (no reasoning_content key anywhere).
    plain = ChunkBuilder(True, "id", "m", 0, 1, False)
    assert all("reasoning_content" not in c["choices"][0]["delta"] for msg in responses(THOUGHT)
               for c in plain.add(msg))


def test_a_resumed_stream_catches_up_through_the_reasoning():
    msgs = responses(THOUGHT[:3])
    builder = ChunkBuilder(True, "id", "m", 0, 1, False, reasoning=Reasoning("deepseek_r1"))
    builder.add(msgs[0])
    builder.skip_text(0, THOUGHT[0] + THOUGHT[1])
    deltas = [c["choices"][0]["delta"] for msg in msgs[3:] for c in builder.add(msg)]
    assert deltas == [{"content": "Sure."}]


def test_token_ids_ride_every_message_through_reasoning_and_tool_calls():
    """vLLM's return_token_ids: every message's ids go out once, on the first chunk it makes, even
    when its text is held back by the tool-call parser or is reasoning; the prompt's ids once, on
    the role chunk; a message with ids and no text still makes a chunk."""
    msgs = [generate_pb2.GenerateResponse(accepted=True, prompt_token_ids=[5, 6])]
    msgs += [generate_pb2.GenerateResponse(text=t, token_ids=[10 + i, 20 + i]) for i, t in enumerate(THOUGHT)]
    msgs.insert(2, generate_pb2.GenerateResponse(token_ids=[99]))  # ids whose text is still held back
    msgs[-1].finish_reason = "stop"
    sent = [i for m in msgs[1:] for i in m.token_ids]
    for reasoning in (Reasoning("deepseek_r1"), None):
        builder = ChunkBuilder(True, "id", "m", 0, 1, False, tools=ToolOutput(parser="hermes"), reasoning=reasoning,
                               token_ids=True)
        chunks = [c for msg in msgs for c in builder.add(msg)]
        assert chunks[0]["prompt_token_ids"] == [5, 6] and all("prompt_token_ids" not in c for c in chunks[1:])
        assert [i for c in chunks[1:] for i in c["choices"][0]["token_ids"]] == sent
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    collector = Collector(1)
    for msg in msgs:
        collector.add(msg)
    out = collector.chat("id", "m", 0, False, ToolOutput(parser="hermes"), Reasoning("deepseek_r1"), token_ids=True)
    assert out["prompt_token_ids"] == [5, 6] and out["choices"][0]["token_ids"] == sent
    plain = ChunkBuilder(True, "id", "m", 0, 1, False, reasoning=Reasoning("deepseek_r1"))
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c for msg in msgs
               for c in plain.add(msg))


GRANITE = ["Here is my thought", " process:\nThe user wants Paris' weather.\nHere", "'s my resp", "onse:\n[{\"name\": ",
           '"get_weather", "arguments": {"city": ', '"Paris"}}]']


def test_granite_reasoning_then_granite_tool_calls_whole_and_streamed():
    """Granite 3.2 with thinking on: its thought, then (its <|tool_call|> skipped as special) the
    bare list of calls, read from the content after "Here's my response:"."""
    output, reasoning = ToolOutput(parser="granite"), Reasoning("granite")
    collector = Collector(1)
    for msg in responses(GRANITE):
        collector.add(msg)
    choice = collector.chat("id", "m", 0, False, output, reasoning)["choices"][0]
    [call] = choice["message"].pop("tool_calls")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["message"] == {"role": "assistant", "content": None,
                                 "reasoning_content": "\nThe user wants Paris' weather.\n"}
    assert choice["finish_reason"] == "tool_calls"
    builder = ChunkBuilder(True, "id", "m", 0, 1, False, tools=output, reasoning=reasoning)
    chunks = [c for msg in responses(GRANITE) for c in builder.add(msg)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nThe user wants Paris' weather.\n"
    assert "".join(d.get("content") or "" for d in deltas) == ""
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}' and len(calls) >= 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

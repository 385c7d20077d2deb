"""--tool-call-parser granite and --reasoning-parser granite through every service, driven by the
official `openai` client. The tiny model's weights are random, so a structured_outputs regex shaped
like Granite's output stands in for a Granite model: its `<|tool_call|>[...]` list of calls (after
some content), and Granite 3.2's "Here is my thought process: ... Here is my response: ..." with
thinking on. With the granite reasoning parser the regex holds from the first token (its markers
are plain text), so the regex writes the markers too."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
GRANITE_CALL = r'Let me check\. <\|tool_call\|>\[\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", ' \
               r'"unit": "c"\}\}\]'
THOUGHT = r" [a-z]{1,8}( [a-z]{1,8}){0,2} "
ANSWER = r" (yes|no)-[0-9]{2}"
THINKING = f"Here is my thought process:{THOUGHT}Here is my response:{ANSWER}"


@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    return launch_stack(tiny_model, tool_call_parser="granite", reasoning_parser="granite", max_num_seqs=8)


def test_auto_reads_granite_calls_whole_and_streamed(client, model_name):
    kw = dict(model=model_name, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=1.0, seed=3,
              extra_body={"structured_outputs": {"regex": GRANITE_CALL}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    [call] = whole.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["unit"] == "c"
    assert (whole.message.model_extra or {}).get("reasoning_content") is None  # thinking off: all content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert content == "Let me check."
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_") and len(deltas) >= 3
    assert all(d.function.name is None and d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_granite_thinking_splits_into_reasoning_content_streamed_and_not(client, model_name):
    kw = dict(model=model_name, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=4,
              extra_body={"structured_outputs": {"regex": THINKING}, "chat_template_kwargs": {"thinking": True}})
    message = client.chat.completions.create(**kw).choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert re.fullmatch(THOUGHT, reasoning), message
    assert re.fullmatch(ANSWER, message.content), message
    parts = {"reasoning_content": [], "content": []}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            parts["reasoning_content"].append((c.delta.model_extra or {}).get("reasoning_content") or "")
            parts["content"].append(c.delta.content or "")
    # Same seed, same tokens: the stream adds up to the whole answer.
    assert ("".join(parts["reasoning_content"]), "".join(parts["content"])) == (reasoning, message.content)

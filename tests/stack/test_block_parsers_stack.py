"""A block tool-call parser (--tool-call-parser qwen3_coder) through every service, driven by the
official `openai` client: a structured_outputs regex shaped like Qwen3-Coder's XML call stands in
for a model trained to write one; the call comes back with its values typed by the tool's schema,
streamed (OpenAI's deltas) and not, with finish_reason tool_calls. The other parsers' formats are
checked without services (tests/test_block_tool_parsers.py)."""

from __future__ import annotations

import json

import pytest

from test_tools_stack import TEMPLATE

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
REGEX = (r"Checking\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n[a-z]{1,6}\n</parameter>\n"
         r"<parameter=days>\n[1-9]\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    (tiny_model / "chat_template.jinja").write_text(TEMPLATE)
    return launch_stack(tiny_model, tool_call_parser="qwen3_coder", max_num_seqs=8)


def test_qwen3_coder_call_streamed_and_not(client, model_name):
    kwargs = dict(model=model_name, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                  max_tokens=80, temperature=1.0, seed=4, extra_body={"structured_outputs": {"regex": REGEX}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(arguments["days"], int)
    assert isinstance(arguments["city"], str)
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]

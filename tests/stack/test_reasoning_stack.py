"""--reasoning-parser through every service, driven by the official `openai` client. The tiny
model's weights are random, so a structured_outputs regex makes it write a thinking block and an
answer after it (as a reasoning model would); the gateway splits the two into reasoning_content and
content, streamed and not, and a request with enable_thinking false gets the text as content."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Yes or no?"}]
THOUGHT = r"[a-z]{1,8}( [a-z]{1,8}){0,2}"
ANSWER = r"(yes|no)-[0-9]{2}"
REGEX = f"<think>{THOUGHT}</think>{ANSWER}"


@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    return launch_stack(tiny_model, reasoning_parser="deepseek_r1", max_num_seqs=8)


def ask(client, model_name, **kwargs):
    extra = kwargs.pop("extra_body", {})
    return dict(model=model_name, messages=MESSAGES, max_tokens=60, temperature=1.0,
                extra_body={"structured_outputs": {"regex": REGEX}, **extra}, **kwargs)


def test_reasoning_content_split_streamed_and_not(client, model_name):
    completion = client.chat.completions.create(**ask(client, model_name, seed=3))
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    message = choice.message
    assert re.fullmatch(THOUGHT, message.reasoning_content), message
    assert re.fullmatch(ANSWER, message.content), message
    # Usage as vLLM counts it: the reasoning's tokens are completion tokens.
    assert completion.usage.completion_tokens > len(message.content)
    stream = client.chat.completions.create(**ask(client, model_name, seed=3, stream=True,
                                                  stream_options={"include_usage": True}))
    reasoning, content, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            reasoning.append(extra.get("reasoning_content") or "")
            content.append(c.delta.content or "")
    # Same seed, same tokens: the stream adds up to the whole answer, and counts the same.
    assert ("".join(reasoning), "".join(content)) == (message.reasoning_content, message.content)
    assert usage.completion_tokens == completion.usage.completion_tokens


def test_enable_thinking_false_reads_the_text_as_content(client, model_name):
    completion = client.chat.completions.create(**ask(
        client, model_name, seed=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    message = completion.choices[0].message
    assert message.reasoning_content is None
    assert re.fullmatch(REGEX, message.content), message.content

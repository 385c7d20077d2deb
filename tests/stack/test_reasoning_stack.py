"""--reasoning-parser through every service, driven by the official `openai` client. A tiny model
made to write a thinking block ("hmm ok</think>", service_stack.bigram_chain_model) answers after it
under a structured_outputs regex (which applies after the reasoning, as vLLM's); the gateway splits
the two into reasoning_content and content, streamed and not, and a request with enable_thinking
false gets the text as content (the regex then holds from the first token: a whole thinking block
and answer)."""

from __future__ import annotations

import re

import pytest

from service_stack import bigram_chain_model

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Yes or no?"}]
THOUGHT = r"[a-z]{1,8}( [a-z]{1,8}){0,2}"
ANSWER = r"(yes|no)-[0-9]{2}"
REGEX = f"<think>{THOUGHT}</think>{ANSWER}"


@pytest.fixture(scope="module")
def stack(default_model_path, tmp_path_factory, launch_stack):
    folder = tmp_path_factory.mktemp("chain-reasoning")
    bigram_chain_model(folder, default_model_path, "hmm ok</think>", "<|im_start|>assistant\n")
    return launch_stack(folder, reasoning_parser="deepseek_r1", max_num_seqs=8)


def ask(client, model_name, regex: str = ANSWER, **kwargs):
    extra = kwargs.pop("extra_body", {})
    return dict(model=model_name, messages=MESSAGES, max_tokens=60, temperature=1.0,
                extra_body={"structured_outputs": {"regex": regex}, **extra}, **kwargs)


def test_reasoning_content_split_streamed_and_not(client, model_name):
    completion = client.chat.completions.create(**ask(client, model_name, seed=3))
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    message = choice.message
    assert re.fullmatch(THOUGHT, message.reasoning_content), message
    assert re.fullmatch(ANSWER, message.content), message
    # Usage as vLLM counts it: the reasoning's tokens are completion tokens.
    assert completion.usage.completion_tokens > len(message.content)
    assert message.reasoning_content == "hmm ok"
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
        client, model_name, REGEX, seed=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    message = completion.choices[0].message
    assert message.reasoning_content is None
    assert re.fullmatch(REGEX, message.content), message.content

"""Structured outputs apply to the content after the reasoning (issue 38 item 1, vLLM's behaviour)
through every service, with the `openai` client: a tiny model made to write a thinking block
("hmm, ok</think>", service_stack.bigram_chain_model) under --reasoning-parser deepseek_r1 keeps
it as reasoning_content, and its content follows the json_schema / regex; streamed and not."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from service_stack import bigram_chain_model

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"],
          "additionalProperties": False}
REGEX = "(yes|no)-[0-9]{2}"


@pytest.fixture(scope="module")
def stack(default_model_path, tmp_path_factory, launch_stack):
    folder = tmp_path_factory.mktemp("chain-stack")
    bigram_chain_model(folder, default_model_path, "hmm, ok</think>", "<|im_start|>assistant\n")
    return launch_stack(folder, reasoning_parser="deepseek_r1")


def ask(client, model_name, stream: bool, **kwargs):
    reply = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Cat or dog?"}],
                                           temperature=0, max_tokens=40, stream=stream, **kwargs)
    if not stream:
        return reply.choices[0].message.reasoning_content, reply.choices[0].message.content
    reasoning, content = [], []
    for chunk in reply:
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_and_regex_after_the_thinking_block(client, model_name, stream):
    schema = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    reasoning, content = ask(client, model_name, stream, response_format=schema)
    assert reasoning == "hmm, ok"
    jsonschema.validate(json.loads(content), SCHEMA)
    reasoning, content = ask(client, model_name, stream, extra_body={"structured_outputs": {"regex": REGEX}})
    assert reasoning == "hmm, ok" and re.fullmatch(REGEX, content), content

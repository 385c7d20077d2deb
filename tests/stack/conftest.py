"""Fixtures of the tests that start the real services as processes (tests/service_stack.py has the
helpers): a tiny model that carries the default model's tokenizer (so the tests that use it are
slow: they need the default model), and stacks that stop when the module's tests are done."""

from __future__ import annotations

from pathlib import Path

import pytest

from service_stack import start_test_stack, tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def tiny_model(default_model_path, tmp_path_factory) -> Path:
    """A tiny random Llama whose vocabulary and tokenizer files are the default model's."""
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-tok"), default_model_path)


@pytest.fixture(scope="module")
def launch_stack(tmp_path_factory):
    """launch_stack(model, logs="logs", **overrides): every service as a process (start_test_stack),
    logging into a fresh folder named after `logs`; each stack it started stops after the module's
    last test, the last started first."""
    stacks = []

    def launch(model: Path, logs: str = "logs", **overrides):
        stack = start_test_stack(model, tmp_path_factory.mktemp(logs), **overrides)
        stacks.append(stack)
        return stack

    yield launch
    for stack in reversed(stacks):
        stack.stop()


@pytest.fixture(scope="module")
def client(stack):
    """The `openai` client on the module's `stack` (a module may define its own)."""
    import openai
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id

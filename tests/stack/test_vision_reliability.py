"""Requests with images survive a killed service: the scheduler keeps each image in the request's Redis
record, so a restarted scheduler resumes it by recompute with its pixels; a restarted worker gets them
again with the resent request. Greedy text equals an uninterrupted run (a tiny LLaVA, real processes,
the launcher's supervisor restarting the dead one)."""

from __future__ import annotations

import base64
import signal
import threading
import time

import openai
import pytest

from tiny_llava import build_tiny_llava, png, with_random_weights

pytestmark = pytest.mark.slow

MAX_TOKENS = 120


@pytest.fixture(scope="module")
def supervised(default_model_path, tmp_path_factory, launch_stack):
    folder = with_random_weights(build_tiny_llava(tmp_path_factory.mktemp("llava-rel"), default_model_path))
    return launch_stack(folder, "logs-vision-sup", max_restarts=3, max_num_batched_tokens=64,
                        kv_cache_memory="64MiB")


def streams(stack, fault=None) -> list[str]:
    """Three concurrent greedy chats, each with its own image; fault(stack) once each has a few tokens."""
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    texts, progress, errors = [""] * 3, [0] * 3, []

    def run(i: int) -> None:
        url = "data:image/png;base64," + base64.b64encode(png(40 + i)).decode()
        try:
            for chunk in client.chat.completions.create(
                    model=model, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True},
                    messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                           {"type": "text", "text": f"Picture {i}?"}]}]):
                if chunk.choices and chunk.choices[0].delta.content:
                    texts[i] += chunk.choices[0].delta.content
                    progress[i] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    if fault is not None:
        deadline = time.monotonic() + 120
        while min(progress) < 3 and time.monotonic() < deadline and not errors:
            time.sleep(0.01)
        assert min(progress) >= 3, f"the streams did not start: {errors}"
        fault(stack)
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return texts


@pytest.mark.parametrize("service", ["scheduler", "worker"])
def test_a_killed_service_resumes_requests_with_images(supervised, service):
    baseline = streams(supervised)
    victim = next(p for p in supervised.processes if p.name.startswith(service))
    old_pid = victim.pid
    assert streams(supervised, lambda stack: victim.signal(signal.SIGKILL)) == baseline
    assert next(p for p in supervised.processes if p.name.startswith(service)).pid != old_pid  # restarted

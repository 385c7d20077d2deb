"""End to end on the default model: the four services as real processes on free ports, Redis at
127.0.0.1:6379 (a fresh key prefix), driven by the official `openai` client and by raw HTTP/gRPC."""

from __future__ import annotations

import json
import signal
import threading
import time

import grpc
import httpx
import pytest

from service_stack import restart, scheduler_stats, wait_until_idle

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The speed of light is"]


@pytest.fixture(scope="module")
def stack(default_model_path, launch_stack):
    return launch_stack(default_model_path, max_num_seqs=32)


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI
    return OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def engine_and_tokenizer(default_model_path):
    """The engine core in this process on the same weights: the reference for greedy outputs."""
    from transformers import AutoTokenizer

    from tiny_models import make_engine
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    return make_engine(default_model_path, tokenizer=tokenizer, kv_cache_memory="128MiB"), tokenizer


def engine_greedy(engine_and_tokenizer, token_ids: list[int], max_tokens: int, **extra) -> list[int]:
    from pagedserve.common.sampling_params import SamplingParams
    engine, _ = engine_and_tokenizer
    [[sample]] = engine.generate([token_ids], SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra))
    return sample.token_ids


def chat_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---- the openai client --------------------------------------------------------------------
def test_chat_completion_streaming_and_not_equal_the_engine(client, model_name, engine_and_tokenizer):
    _, tokenizer = engine_and_tokenizer
    reference = tokenizer.decode(engine_greedy(engine_and_tokenizer, chat_ids(tokenizer, CHAT), 40),
                                 skip_special_tokens=True)
    reply = client.chat.completions.create(model=model_name, messages=CHAT, temperature=0, max_tokens=40)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == reference
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == len(chat_ids(tokenizer, CHAT))

    chunks = list(client.chat.completions.create(model=model_name, messages=CHAT, temperature=0, max_tokens=40,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [reply.choices[0].finish_reason]


def test_completion_equals_the_engine(client, model_name, engine_and_tokenizer):
    _, tokenizer = engine_and_tokenizer
    prompt = PROMPTS[0]
    ids = engine_greedy(engine_and_tokenizer, tokenizer.encode(prompt), 24)
    reply = client.completions.create(model=model_name, prompt=prompt, temperature=0, max_tokens=24)
    assert reply.object == "text_completion"
    assert reply.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    assert reply.usage.completion_tokens == len(ids)


def test_sixteen_concurrent_streams_finish_with_their_token_counts(client, model_name, stack):
    wanted = {i: 8 + i for i in range(16)}
    results: dict[int, tuple[int, str, str]] = {}
    errors = []

    def run(i: int) -> None:
        try:
            stream = client.completions.create(model=model_name, prompt=PROMPTS[i % len(PROMPTS)] + f" ({i})",
                                               max_tokens=wanted[i], temperature=0.8, seed=i, stream=True,
                                               stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
            text, reason, usage = "", None, None
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    reason = chunk.choices[0].finish_reason or reason
                if chunk.usage:
                    usage = chunk.usage
            results[i] = (usage.completion_tokens, reason, text)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"{i}: {exc!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert {i: r[0] for i, r in results.items()} == wanted
    assert all(r[1] == "length" and r[2] for r in results.values())
    assert wait_until_idle(stack).num_running == 0


def test_a_disconnected_stream_frees_its_blocks(stack, model_name):
    before = scheduler_stats(stack)
    body = {"model": model_name, "prompt": PROMPTS[2], "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", stack.http_url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines, seen, busy = 0, [], None
            for line in response.iter_lines():
                lines += line.startswith("data: ")
                seen.append(line[:120])
                if lines >= 3:
                    busy = scheduler_stats(stack)
                    if busy.num_running == 1 and busy.num_free_gpu_blocks < busy.num_gpu_blocks or lines >= 60:
                        break  # running and holding blocks (a moment's preemption on a loaded machine is not)
            assert busy is not None and busy.num_running == 1 and busy.num_free_gpu_blocks < busy.num_gpu_blocks, \
                (busy, seen[-4:])
    stats = wait_until_idle(stack, timeout_s=10)
    assert stats.num_running == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert stats.generation_tokens_total - before.generation_tokens_total < 500  # stopped, not run to the end


def test_idempotency_key_attaches_a_retry_to_the_same_generation(stack, model_name):
    body = {"model": model_name, "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 1.0}
    headers = {"Idempotency-Key": f"retry-{time.time_ns()}"}
    with httpx.Client(timeout=60) as http:
        first = http.post(stack.http_url + "/v1/completions", json=body, headers=headers).json()
        second = http.post(stack.http_url + "/v1/completions", json=body, headers=headers).json()
        third = http.post(stack.http_url + "/v1/completions", json=body).json()  # no key: a new generation
    assert second["id"] == first["id"] and second["choices"][0]["text"] == first["choices"][0]["text"]
    assert third["id"] != first["id"]
    assert scheduler_stats(stack).requests_finished_total >= 2


def test_request_record_has_the_timeline(stack, client, model_name):
    reply = client.completions.create(model=model_name, prompt=PROMPTS[3], temperature=0, max_tokens=8)
    record = httpx.get(f"{stack.http_url}/v1/requests/{reply.id}", timeout=30).json()
    text = json.dumps(record)
    assert reply.id in text and "finished" in text
    for stage in ("gateway_received", "scheduler_received", "first_token", "finished"):
        assert stage in text, stage
    import redis
    client_redis = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    internal = f"anon.{reply.id}"  # the services' id: the owner (no keys: anonymous), then the client's
    for key in (f"{stack.redis_prefix}req:{internal}", f"{stack.redis_prefix}out:{internal}:0"):
        assert 0 < client_redis.ttl(key) <= 24 * 3600, key  # every record expires
    assert internal.encode() not in client_redis.smembers(f"{stack.redis_prefix}active")
    missing = httpx.get(f"{stack.http_url}/v1/requests/no-such-request", timeout=30)
    assert missing.status_code == 404 and "error" in missing.json()


def test_public_grpc_generate_streams_the_same_text(stack, client, model_name):
    from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
    reference = client.completions.create(model=model_name, prompt=PROMPTS[0], temperature=0, max_tokens=16)
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stream = generate_pb2_grpc.GenerationStub(channel).Generate(generate_pb2.GenerateRequest(
            prompt=PROMPTS[0], params=common_pb2.SamplingParams(temperature=0, max_tokens=16),
            skip_special_tokens=True), timeout=120)
        messages = list(stream)
    assert messages[0].accepted
    assert "".join(m.text for m in messages) == reference.choices[0].text
    assert messages[-1].finish_reason and messages[-1].usage.completion_tokens == reference.usage.completion_tokens
    assert messages[-1].timings.first_token > 0


def test_metrics_name_the_stages(stack, client, model_name):
    client.completions.create(model=model_name, prompt=PROMPTS[3], temperature=0, max_tokens=4)
    text = httpx.get(stack.http_url + "/metrics", timeout=30).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache",
                 "time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "prompt_tokens", "generation_tokens", "num_preemptions"):
        assert name in text, name
    assert "stage=" in text


def test_errors_in_openai_shape(stack, model_name):
    url = stack.http_url + "/v1/completions"
    cases = [
        ({"model": model_name, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": model_name, "prompt": "hi", "max_tokens": 10**6}, 400, "context"),
        ({"model": model_name, "prompt": "hi", "n": 1000}, 400, "n"),
        ({"model": "no-such-model", "prompt": "hi"}, 404, "no-such-model"),
    ]
    with httpx.Client(timeout=60) as http:
        for body, status, word in cases:
            for stream in (False, True):
                reply = http.post(url, json={**body, "stream": stream})
                assert reply.status_code == status, (body, reply.text)
                error = reply.json()["error"]
                assert word in error["message"] and error["type"], (body, error)
        assert http.get(stack.http_url + "/health").status_code == 200  # still up


def test_reflection_lists_every_service(stack):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    expected = {"worker0": "pagedserve.v1.Worker", "scheduler": "pagedserve.v1.Scheduler",
                "tokenizer": "pagedserve.v1.Tokenizer", "gateway": "pagedserve.v1.Generation"}
    for name, service in expected.items():
        with grpc.insecure_channel(stack.addresses[name]) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            [reply] = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                     timeout=10))
            names = {s.name for s in reply.list_services_response.service}
            assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names, name


def test_killed_scheduler_resumes_in_flight_requests_from_redis(stack, client, model_name):
    """Runs last in this module: it replaces the scheduler process."""
    def run_all(progress: list[int] | None) -> list[str]:
        texts = [""] * len(PROMPTS)

        def run(i: int) -> None:
            try:
                stream = client.completions.create(model=model_name, prompt=PROMPTS[i], max_tokens=48,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True})
                for chunk in stream:
                    if chunk.choices:
                        texts[i] += chunk.choices[0].text
                        if progress is not None:
                            progress[i] += 1
                        if chunk.choices[0].finish_reason:
                            endings[i] = chunk.choices[0].finish_reason
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                endings[i] = f"{type(exc).__name__}: {exc}"

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        if progress is not None:
            deadline = time.monotonic() + 120
            while min(progress) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert min(progress) >= 3, "the streams did not start"
            restart(stack, "scheduler", signal.SIGKILL)
        for t in threads:
            t.join(timeout=300)
        return texts

    # How each stream ended: its finish_reason, or the exception its thread caught (a thread's
    # exception would otherwise only be printed, leaving a short text to explain it).
    endings: list[str] = [""] * len(PROMPTS)
    interrupted = run_all([0] * len(PROMPTS))
    assert endings == ["length"] * len(PROMPTS), endings
    uninterrupted = run_all(None)
    assert interrupted == uninterrupted
    assert all(interrupted)

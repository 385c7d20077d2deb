"""The gateway over HTTP (real uvicorn, the openai client) and its public gRPC API, in front of
fake tokenizer and scheduler services whose behaviour each prompt selects (tests/fake_services.py)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import openai
import pytest

from fake_services import ALIAS, KEY, MODEL, Stack
from pagedserve.gateway.owners import owner_of_key
from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    s.close()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY, max_retries=0)


def test_completion_and_chat_non_streaming(stack, client):
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=5, temperature=0)
    assert out.id.startswith("cmpl-") and out.choices[0].text == "Hello world"
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 2, 5)
    req = stack.tokenizer.requests[-1]
    # Downstream the request is known by the internal id: the owner (a digest of the key), then the client's id.
    assert req.request_id == owner_of_key(KEY) + "." + out.id
    assert req.timings.gateway_received > 0 and req.params.max_tokens == 5
    chat = client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], n=2)
    assert chat.id.startswith("chatcmpl-") and [c.message.content for c in chat.choices] == ["Hello world"] * 2
    assert chat.choices[1].message.role == "assistant"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (3, 4)  # prompt once, samples summed


def test_streaming_chat_with_usage(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                                            stream_options={"include_usage": True}, logprobs=True, top_logprobs=1)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello world"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    lps = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert [lp.token for lp in lps] == ["Hello", " world"] and lps[0].top_logprobs[0].logprob == -0.5


def test_continuous_usage_stats_put_each_choices_usage_on_every_chunk(stack):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk with a choice carries
    that choice's usage so far; without it (or without include_usage) the chunks are as before."""
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = naive_sse_read(stack.url + "/v1/chat/completions", body)
    with_choice = [c for c in chunks if c["choices"]]
    assert with_choice and all(c["usage"]["prompt_tokens"] == 3 for c in with_choice)
    for index in (0, 1):
        mine = [c["usage"]["completion_tokens"] for c in with_choice if c["choices"][0]["index"] == index]
        assert mine[0] == 0 and mine[-1] == 2 and mine == sorted(mine), mine  # the role chunk first
        assert all(c["usage"]["total_tokens"] == 3 + c["usage"]["completion_tokens"] for c in with_choice)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4  # both samples
    completion = naive_sse_read(stack.url + "/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 3,
                                                                "stream_options": body["stream_options"]})
    assert [c["usage"]["completion_tokens"] for c in completion if c["choices"]][-1] == 2
    for options in ({"continuous_usage_stats": True}, {"include_usage": True}):
        plain = naive_sse_read(stack.url + "/v1/chat/completions", {**body, "stream_options": options})
        assert all("usage" not in c for c in plain if c["choices"])


def naive_sse_read(url: str, body: dict) -> list[dict]:
    """How vLLM's `bench serve` client (async_request_openai_completions / _chat_completions) and
    many hand-written readers consume a stream: every non-empty line, `data: ` stripped, is JSON
    until [DONE]. Any other SSE field (an `id:` line) breaks them."""
    chunks = []
    with httpx.stream("POST", url, headers={"Authorization": f"Bearer {KEY}"}, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            line = line.strip()
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            chunks.append(json.loads(data))
    return chunks


def test_stream_is_byte_compatible_with_naive_sse_readers(stack):
    chunks = naive_sse_read(stack.url + "/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 3,
                                                           "stream_options": {"include_usage": True}})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello world"
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    chunks = naive_sse_read(stack.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                "stream": True, "max_tokens": 3})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Hello world"


def test_streaming_completion_raw_sse(stack):
    def raw_lines(body: dict) -> list[str]:
        with httpx.stream("POST", stack.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            return [line for line in r.iter_lines() if line]

    body = {"prompt": "hi", "stream": True, "echo": True, "max_tokens": 3}
    # By default the bytes are OpenAI's: `data: ` lines only, no SSE `id:` field.
    lines = raw_lines(body)
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines), lines
    assert '"text":"hi"' in lines[0] and '"object":"text_completion"' in lines[0]
    # Opted in, every event but [DONE] carries an id (the resume cursor: tokens:chars so far).
    raw = raw_lines({**body, "stream_options": {"include_event_ids": True}})
    assert raw[0] == "id: 0:0" and raw[-3].startswith("id: ") and raw[-3].endswith(":f"), raw
    data = [line for line in raw if not line.startswith("id: ")]
    assert len(data) == len(lines) and all(line.startswith("data: ") for line in data)


def test_completion_logprobs_shape(client):
    out = client.completions.create(model=MODEL, prompt="hi", logprobs=1)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["Hello", " world"] and lp.token_logprobs == [-0.5, -0.5] and lp.text_offset == [0, 5]
    assert lp.top_logprobs == [{"Hello": -0.5}, {" world": -0.5}]


def test_errors_map_to_openai_statuses(stack, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="toolong")
    assert "exceeds" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1000)  # over max_model_len
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt="hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "full"}], stream=True)
    assert e.value.response.headers["retry-after"]
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="loading")
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.post(stack.url + "/v1/completions", json={"prompt": "hi", "temperature": "hot"},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(stack.url + "/v1/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_error_after_headers_is_reported_in_stream(client):
    with pytest.raises(openai.APIError):
        list(client.completions.create(model=MODEL, prompt="crash", stream=True))


def test_client_disconnect_cancels_the_generation(stack):
    stack.tokenizer.cancelled.clear()
    with httpx.stream("POST", stack.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "slow", "stream": True}) as r:
        for line in r.iter_lines():
            if "tick" in line:
                break  # leaving the block closes the connection mid-stream
    assert stack.tokenizer.cancelled.wait(20), "the gRPC call was not cancelled on disconnect"


def test_client_disconnect_cancels_a_non_streamed_generation(stack):
    stack.tokenizer.cancelled.clear()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "slow"}, timeout=0.5)
    assert stack.tokenizer.cancelled.wait(20), "the gRPC call was not cancelled on disconnect"


def test_idempotency_key_reuses_the_request_id(stack, client):
    first = client.completions.create(model=MODEL, prompt="hi", extra_headers={"Idempotency-Key": "abc"})
    second = client.completions.create(model=MODEL, prompt="hi", extra_headers={"Idempotency-Key": "abc"})
    assert first.id == second.id and stack.tokenizer.requests[-1].request_id == owner_of_key(KEY) + "." + first.id
    assert client.completions.create(model=MODEL, prompt="hi").id != first.id
    # The same key with another body is a client bug, not a retry.
    with pytest.raises(openai.UnprocessableEntityError, match="different request body"):
        client.completions.create(model=MODEL, prompt="hello", extra_headers={"Idempotency-Key": "abc"})
    # A key whose request was refused is free again: nothing was generated under it.
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="full", extra_headers={"Idempotency-Key": "refused"})
    assert client.completions.create(model=MODEL, prompt="hi", extra_headers={"Idempotency-Key": "refused"})


def test_models_health_metrics_and_request_status(stack, client):
    model, alias = client.models.list().data  # --served-model-name's names, the first first (vLLM's list)
    assert (model.id, alias.id, alias.root) == (MODEL, ALIAS, MODEL) and model.model_extra["max_model_len"] == 128
    assert client.models.retrieve(ALIAS) == alias  # OpenAI's retrieve: one entry of the list
    with pytest.raises(openai.NotFoundError, match="The model 'gpt-4' does not exist") as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    r = httpx.get(stack.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    for ping in (httpx.get(stack.url + "/ping"), httpx.post(stack.url + "/ping")):  # vLLM's, open as /health
        assert ping.status_code == 200 and ping.json() == r.json()
    version = httpx.get(stack.url + "/version")
    assert version.status_code == 200 and version.json()["version"].count(".") == 2
    client.completions.create(model=MODEL, prompt="hi")
    text = httpx.get(stack.url + "/metrics").text
    model = f'model_name="{MODEL}"'
    for needle in (f"pagedserve:num_requests_running{{{model}}} 2.0", f"pagedserve:kv_cache_usage_perc{{{model}}} 0.25",
                   f"pagedserve:prefix_cache_hit_rate{{{model}}} 0.4", "pagedserve:time_to_first_token_seconds_count",
                   f'pagedserve:request_stage_seconds_count{{{model},stage="scheduler_queue"}}',
                   f'pagedserve:request_success_total{{finished_reason="length",{model}}}',
                   f'pagedserve:http_requests_total{{endpoint="/v1/completions",{model},status="200"}}',
                   # vLLM's names, for its Grafana dashboard and autoscalers
                   f"vllm:num_requests_running{{{model}}} 2.0", f"vllm:gpu_cache_usage_perc{{{model}}} 0.25",
                   f"vllm:kv_cache_usage_perc{{{model}}} 0.25", f"vllm:time_to_first_token_seconds_count{{{model}}}",
                   f'vllm:request_success_total{{finished_reason="length",{model}}}'):
        assert needle in text, needle
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(stack.url + "/v1/requests/known", headers=headers)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "finished" and body["prompt_tokens"] == 3
    assert body["samples"] == [{"index": 0, "output_tokens": 2, "finish_reason": "stop"}]
    assert {s["stage"]: s["duration_s"] for s in body["timeline"]}["queue"] == 1.0
    r = httpx.get(stack.url + "/v1/requests/nope", headers=headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
    stack.tokenizer.ready = False
    stack.backend._info = None
    try:
        deadline = time.monotonic() + 20  # /health's answer is shared for ~0.5 s
        while (r := httpx.get(stack.url + "/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.status_code == 503 and r.json()["status"] == "loading"
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL, prompt="hi")
    finally:
        stack.tokenizer.ready = True


def test_health_and_metrics_pollers_share_one_fetch(stack):
    """Issue 42 row 6: /health and /metrics take no key and asked the tokenizer and the scheduler
    for every poll. 64 pollers of each at once: the answers are shared (~0.5 s), so the services
    are asked a few times, not 128."""
    async def poll_all() -> list[int]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            replies = await asyncio.gather(*(client.get(path) for _ in range(64) for path in ("/health", "/metrics")))
        return [r.status_code for r in replies]

    time.sleep(0.6)  # whatever an earlier test left cached has aged
    stats, infos = stack.scheduler.stats_calls, stack.tokenizer.model_info_calls
    started = time.monotonic()
    assert set(asyncio.run(poll_all())) == {200}
    rounds = 1 + int((time.monotonic() - started) / 0.5)  # answers that may have aged meanwhile
    assert stack.scheduler.stats_calls - stats <= 2 * rounds, stack.scheduler.stats_calls - stats
    assert stack.tokenizer.model_info_calls - infos <= rounds


def test_public_grpc_api(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        auth = [("authorization", f"Bearer {KEY}")]
        msgs = list(stub.Generate(generate_pb2.GenerateRequest(prompt="hi"), metadata=auth, timeout=10))
        assert msgs[0].accepted and "".join(m.text for m in msgs) == "Hello world"
        assert stack.tokenizer.requests[-1].timings.gateway_received > 0
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(generate_pb2.GenerateRequest(prompt="hi"), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(generate_pb2.GenerateRequest(prompt="hi", model="x"), metadata=auth, timeout=10))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(generate_pb2.GenerateRequest(prompt="full"), metadata=auth, timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        bad = generate_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(temperature=-1))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, metadata=auth, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.GetModelInfo(generate_pb2.ModelInfoRequest(), metadata=auth, timeout=10).model == MODEL
        stack.tokenizer.cancelled.clear()
        call = stub.Generate(generate_pb2.GenerateRequest(prompt="slow"), metadata=auth, timeout=30)
        next(call)
        next(call)
        call.cancel()
        assert stack.tokenizer.cancelled.wait(20)  # generous: on a loaded machine it has taken over 5 s


def test_resume_records_in_redis_or_in_process():
    import uuid

    import redis

    from pagedserve.common.store import MemoryStore, RedisStore
    from pagedserve.gateway.resume_records import ResumeRecords

    local = ResumeRecords(MemoryStore())  # no Redis: kept in this process
    asyncio.run(local.save("cmpl-1", {"n": 2}))
    assert local.local["cmpl-1"] == '{"n":2}' and asyncio.run(local.load("cmpl-1")) == {"n": 2}
    assert asyncio.run(local.load("cmpl-2")) is None
    prefix = f"pstest-{uuid.uuid4().hex[:8]}:"
    shared = ResumeRecords(RedisStore("redis://127.0.0.1:6379/0", prefix, ttl_s=60))
    asyncio.run(shared.save("cmpl-1", {"chat": True}))
    assert not shared.local  # in Redis, where any gateway of the stack reads it
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0", decode_responses=True)
    try:
        assert client.get(f"{prefix}gwresume:cmpl-1") == '{"chat":true}'
        assert 0 < client.ttl(f"{prefix}gwresume:cmpl-1") <= 60
        other = ResumeRecords(RedisStore("redis://127.0.0.1:6379/0", prefix, ttl_s=60))
        assert asyncio.run(other.load("cmpl-1")) == {"chat": True}
    finally:
        client.delete(f"{prefix}gwresume:cmpl-1")


def test_tokenizer_endpoints_are_behind_the_key(stack):
    # vLLM leaves /tokenize and /detokenize outside its /v1 key check; here they need the key too.
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(stack.url + path, json=body).status_code == 401
        r = httpx.post(stack.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code not in (401, 404), r.text  # past the gate (the fake tokenizer answers)
    # vLLM's score and rerank paths outside /v1 too; this (generate) server answers them as vLLM does
    score, rerank = {"text_1": "a", "text_2": "b"}, {"query": "q", "documents": ["d"]}
    for path, body in (("/score", score), ("/v1/score", score), ("/rerank", rerank), ("/v1/rerank", rerank),
                       ("/v2/rerank", rerank)):
        assert httpx.post(stack.url + path, json=body).status_code == 401
        r = httpx.post(stack.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text
        assert "--runner pooling" in r.json()["error"]["message"]


def test_every_served_name_is_the_model_and_answers_under_it(stack, client):
    """--served-model-name a b (vLLM's): a request may name either; its answer carries the name it sent
    (no name: the first); another name is 404 on REST and NOT_FOUND on gRPC."""
    assert client.completions.create(model=ALIAS, prompt="hi").model == ALIAS
    assert client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}]).model == ALIAS
    assert client.completions.create(model=MODEL, prompt="hi").model == MODEL
    assert httpx.post(stack.url + "/v1/completions", json={"prompt": "hi"},
                      headers={"Authorization": f"Bearer {KEY}"}).json()["model"] == MODEL
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="fake-other", prompt="hi")
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        auth = (("authorization", f"Bearer {KEY}"),)
        assert list(stub.Generate(generate_pb2.GenerateRequest(model=ALIAS, prompt="hi"), metadata=auth, timeout=30))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generate_pb2.GenerateRequest(model="fake-other", prompt="hi"), metadata=auth,
                               timeout=30))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

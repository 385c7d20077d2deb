"""Fuzzing the real stack (every service a process, real Redis) on a tiny model.

(a) `schemathesis run` against the gateway's OpenAPI schema: every operation, up to 50 generated
    examples each, deterministic; no 5xx (the not_a_server_error check) and no hang (10 s per request).
(b) hypothesis-generated malformed gRPC requests to the gateway's public Generation/Generate and to
    the scheduler's internal Scheduler/Generate: each ends OK or with a deliberate status
    (INVALID_ARGUMENT, NOT_FOUND, ...), never INTERNAL or UNKNOWN, never a hang; afterwards the
    stack still answers a normal request and every KV block is free.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from service_stack import wait_until_idle

pytestmark = pytest.mark.slow  # the tiny model borrows the default model's tokenizer

KEY = "sk-fuzz-key"
METADATA = (("authorization", f"Bearer {KEY}"),)
REQUEST_TIMEOUT_S = 10.0
RPC_TIMEOUT_S = 30.0
# Statuses that are a deliberate refusal; anything else but OK (INTERNAL, UNKNOWN, DEADLINE_EXCEEDED
# on a short request, UNAVAILABLE from a dead service) is a bug.
DELIBERATE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION,
              grpc.StatusCode.ALREADY_EXISTS}  # an id in use by another prompt, or by a sample of another request
FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    # A short context keeps every accepted generation short (unset max_tokens: up to the context).
    return launch_stack(tiny_model, api_key=KEY, max_model_len=128)


def assert_serves_normally(stack) -> None:
    reply = httpx.post(stack.http_url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"prompt": "hello there", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")
    stats = wait_until_idle(stack, 60)
    assert stats.num_running == stats.num_waiting == 0, stats
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks, stats


# ---- (a) schemathesis against /openapi.json -------------------------------------------------------

RESUME = "/v1/requests/{request_id}/stream"
def schemathesis_run(stack, tmp_path, *selection: str) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).parent / "schemathesis"
    argv = [str(cli), "run", stack.http_url + "/openapi.json", *selection, "--checks", "not_a_server_error",
            "--max-examples", "50", "--generation-deterministic", "--request-timeout", str(REQUEST_TIMEOUT_S),
            "--workers", "1", "--phases", "examples,coverage,fuzzing", "-H", f"Authorization: Bearer {KEY}",
            "--no-color", "--report", "junit", "--report-junit-path", str(tmp_path / "junit.xml")]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    print(run.stdout[-3000:])
    return run


def api_paths(stack) -> set[str]:
    return set(httpx.get(stack.http_url + "/openapi.json", timeout=30,  # the API's description wants a key
                         headers={"Authorization": f"Bearer {KEY}"}).json()["paths"])


def test_openapi_no_server_error(stack, tmp_path):
    """schemathesis run, as a subprocess: every operation of /openapi.json (but the stream resume, below),
    50 examples each at most, deterministic; a 5xx or a request over 10 s fails it (exit code 1)."""
    run = schemathesis_run(stack, tmp_path, "--exclude-path", RESUME)
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-4000:]


def test_openapi_resume_stream_no_server_error(stack, tmp_path):
    assert RESUME in api_paths(stack)
    run = schemathesis_run(stack, tmp_path, "--include-path", RESUME)
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-4000:]


def test_resume_unknown_request_is_404(stack):
    assert RESUME in api_paths(stack)
    reply = httpx.get(stack.http_url + "/v1/requests/no-such-request/stream", timeout=REQUEST_TIMEOUT_S,
                      headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 404, (reply.status_code, reply.text)


# schemathesis sends UTF-8 bodies, which cannot carry a lone UTF-16 surrogate; JSON's \\uD800
# escapes can. Each string field of a valid body, in turn, gets one: a 400 naming the field, never a 5xx.
SURROGATE_BODIES = {
    "/v1/completions": {"prompt": "hello", "model": None, "stop": ["x"], "user": "u", "suffix": "s"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi", "name": "n"}], "stop": "x",
                             "user": "u"},
}


@FUZZ
@given(endpoint=st.sampled_from(sorted(SURROGATE_BODIES)), surrogate=st.integers(0xD800, 0xDFFF),
       where=st.integers(0, 100), prefix=st.text(max_size=5))
def test_lone_surrogates_in_any_string_field_are_400(stack, endpoint, surrogate, where, prefix):
    import json

    body = json.loads(json.dumps(SURROGATE_BODIES[endpoint]))
    paths = []

    def walk(node, path):
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(value, (dict, list)):
                walk(value, path + [key])
            elif isinstance(value, str) or value is None:
                paths.append(path + [key])

    walk(body, [])
    path = paths[where % len(paths)]
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = prefix + chr(surrogate)
    reply = httpx.post(stack.http_url + endpoint, content=json.dumps(body).encode(), timeout=REQUEST_TIMEOUT_S,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert reply.status_code == 400, (path, reply.status_code, reply.text)
    assert "surrogate" in reply.json()["error"]["message"]


def test_serves_after_openapi_fuzz(stack):
    assert_serves_normally(stack)


# ---- (b) malformed gRPC Generate requests ---------------------------------------------------------

U32 = 2**32 - 1
I32 = 2**31 - 1
I64 = 2**63 - 1
VOCAB = 49152  # the tiny model's (the default model's tokenizer)
wild_float = st.one_of(st.sampled_from([float("nan"), float("inf"), float("-inf"), -1.0, -1e-300, 1e300]),
                       st.floats(allow_nan=True, allow_infinity=True))
wild_u32 = st.one_of(st.sampled_from([0, 2**31, U32]), st.integers(0, U32))
wild_i32 = st.one_of(st.sampled_from([-I32 - 1, -1, I32]), st.integers(-I32 - 1, I32))
text = st.text(max_size=30)
huge_text = st.builds(lambda s, k: s * k, st.text(min_size=1, max_size=5), st.integers(2000, 50_000))
wild_ids = st.one_of(
    st.just([]),
    st.lists(st.integers(VOCAB, U32), min_size=1, max_size=8),   # out of the vocabulary
    st.builds(lambda k: [7] * k, st.integers(129, 20_000)),       # longer than the context (128)
)


@st.composite
def valid_params(draw) -> common_pb2.SamplingParams:
    """Sampling parameters the services accept, drawn over their whole valid ranges."""
    max_tokens = draw(st.integers(1, 8))
    p = common_pb2.SamplingParams(
        n=draw(st.integers(0, 2)), top_k=draw(st.integers(-1, 50)), min_p=draw(st.floats(0, 1)),
        presence_penalty=draw(st.floats(-2, 2)), frequency_penalty=draw(st.floats(-2, 2)),
        min_tokens=draw(st.integers(0, max_tokens)), max_tokens=max_tokens,
        stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)), ignore_eos=draw(st.booleans()))
    if draw(st.booleans()):
        p.temperature = draw(st.floats(0, 2))
    if draw(st.booleans()):
        p.top_p = draw(st.floats(0.01, 1))
    if draw(st.booleans()):
        p.repetition_penalty = draw(st.floats(0.5, 2))
    if draw(st.booleans()):
        p.seed = draw(st.integers(-I64 - 1, I64))
    if draw(st.booleans()):
        p.logprobs = draw(st.integers(0, 5))
    return p


# One field each, set to a value out of its valid range (or a strange one that may still be valid).
PARAM_CORRUPTIONS = {
    "n": wild_u32, "temperature": wild_float, "top_p": wild_float, "top_k": wild_i32, "min_p": wild_float,
    "repetition_penalty": wild_float, "presence_penalty": wild_float, "frequency_penalty": wild_float,
    "max_tokens": wild_u32, "min_tokens": wild_u32, "logprobs": wild_u32,
    "seed": st.sampled_from([-I64 - 1, I64]), "stop_token_ids": st.lists(st.integers(VOCAB, U32), min_size=1),
}


def corrupt_params(draw, params: common_pb2.SamplingParams, names) -> None:
    for name in names:
        value = draw(PARAM_CORRUPTIONS[name])
        if name == "stop_token_ids":
            params.stop_token_ids.extend(value)
        else:
            setattr(params, name, value)


@st.composite
def generate_requests(draw) -> generate_pb2.GenerateRequest:
    """A valid public GenerateRequest, then none to three of its fields made malformed."""
    req = generate_pb2.GenerateRequest(
        params=draw(valid_params()), stop=draw(st.lists(text, max_size=2)),
        include_stop_str_in_output=draw(st.booleans()), skip_special_tokens=draw(st.booleans()),
        priority=draw(st.integers(-5, 5)), echo=draw(st.booleans()))
    kind = draw(st.sampled_from(["prompt", "ids", "chat"]))
    if kind == "prompt":
        req.prompt = draw(st.text(min_size=1, max_size=40))
    elif kind == "ids":
        req.prompt_token_ids.ids.extend(draw(st.lists(st.integers(3, 300), min_size=1, max_size=8)))
    else:
        req.chat.messages.append(generate_pb2.ChatMessage(role="user", content=draw(st.text(max_size=40))))
        req.chat.add_generation_prompt = draw(st.booleans())
    fields = ["model", "huge_prompt", "ids", "no_input", "chat", "stop", "request_id", "priority", "timings",
              *PARAM_CORRUPTIONS]
    for field in draw(st.lists(st.sampled_from(fields), max_size=3, unique=True)):
        if field == "model":
            req.model = draw(st.sampled_from(["no-such-model", "\x00", " "]) | text)
        elif field == "huge_prompt":
            req.prompt = draw(huge_text)
        elif field == "ids":
            req.prompt_token_ids.Clear()
            req.prompt_token_ids.ids.extend(draw(wild_ids))
        elif field == "no_input":
            req.ClearField("input")
        elif field == "chat":
            roles = st.sampled_from(["user", "system", "assistant", "tool", "", "\x00", "x" * 1000])
            messages = draw(st.lists(st.tuples(roles, st.one_of(text, huge_text)), max_size=3))
            req.chat.Clear()
            req.chat.messages.extend(generate_pb2.ChatMessage(role=r, content=c) for r, c in messages)
        elif field == "stop":
            req.stop.extend(draw(st.lists(st.one_of(st.just(""), huge_text), min_size=1, max_size=3)))
        elif field == "request_id":
            req.request_id = draw(st.one_of(text, huge_text))
        elif field == "priority":
            req.priority = draw(wild_i32)
        elif field == "timings":
            req.timings.gateway_received = draw(wild_float)
            req.timings.scheduler_received = draw(wild_float)
        else:
            corrupt_params(draw, req.params, [field])
    return req


@st.composite
def schedule_requests(draw) -> scheduler_pb2.ScheduleRequest:
    """A valid internal ScheduleRequest, then none to three of its fields made malformed."""
    req = scheduler_pb2.ScheduleRequest(
        prompt_token_ids=draw(st.lists(st.integers(3, 300), min_size=1, max_size=8)), params=draw(valid_params()),
        priority=draw(st.integers(-5, 5)))
    fields = ["ids", "request_id", "priority", "timings", "attach", "skip_tokens", *PARAM_CORRUPTIONS]
    for field in draw(st.lists(st.sampled_from(fields), max_size=3, unique=True)):
        if field == "ids":
            del req.prompt_token_ids[:]
            req.prompt_token_ids.extend(draw(wild_ids))
        elif field == "request_id":
            req.request_id = draw(st.one_of(text, huge_text))
        elif field == "priority":
            req.priority = draw(wild_i32)
        elif field == "timings":
            req.timings.scheduler_received = draw(wild_float)
            req.timings.first_token = draw(wild_float)
        elif field == "attach":
            req.attach = True
            req.request_id = req.request_id or draw(text)
        elif field == "skip_tokens":
            req.skip_tokens.extend(draw(st.lists(wild_u32, min_size=1, max_size=3)))
        else:
            corrupt_params(draw, req.params, [field])
    return req


def outcome(responses) -> str:
    """Consume a server stream: 'OK' (then a sample finished) or the status name; a status that is not
    deliberate fails."""
    finished = 0
    try:
        for message in responses:
            finished += bool(message.finish_reason)
    except grpc.RpcError as exc:
        assert exc.code() in DELIBERATE, f"{exc.code()}: {exc.details()}"
        return exc.code().name
    assert finished, "a stream that ended OK without a finish_reason"
    return "OK"


def describe(request) -> str:
    s = str(request)
    return s if len(s) < 2000 else s[:2000] + f"... ({len(s)} characters)"


@pytest.fixture(scope="module")
def gateway_channel(stack):
    with grpc.insecure_channel(stack.addresses["grpc"], options=[("grpc.max_send_message_length", -1)]) as channel:
        yield channel


@pytest.fixture(scope="module")
def scheduler_channel(stack):
    with grpc.insecure_channel(stack.addresses["scheduler"],
                               options=[("grpc.max_send_message_length", -1)]) as channel:
        yield channel


def test_gateway_grpc_generate_malformed(stack, gateway_channel):
    stub = generate_pb2_grpc.GenerationStub(gateway_channel)
    seen: dict[str, int] = {}

    @FUZZ
    @given(generate_requests())
    def check(request):
        try:
            code = outcome(stub.Generate(request, metadata=METADATA, timeout=RPC_TIMEOUT_S))
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nrequest:\n{describe(request)}") from None
        seen[code] = seen.get(code, 0) + 1

    check()
    print(f"\ngateway Generate outcomes: {seen}")
    assert_serves_normally(stack)


def test_scheduler_grpc_generate_malformed(stack, scheduler_channel):
    stub = scheduler_pb2_grpc.SchedulerStub(scheduler_channel)
    seen: dict[str, int] = {}

    @FUZZ
    @given(schedule_requests())
    def check(request):
        try:
            code = outcome(stub.Generate(request, timeout=RPC_TIMEOUT_S))
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nrequest:\n{describe(request)}") from None
        seen[code] = seen.get(code, 0) + 1

    check()
    print(f"\nscheduler Generate outcomes: {seen}")
    assert_serves_normally(stack)


def test_scheduler_concurrent_duplicate_and_colliding_ids(stack, scheduler_channel):
    """Issue 13: eight Generate calls for one new id at once, each with another prompt, and the
    sample-id collision (`X#1` running, then `X` with n=2), beside a bystander: one duplicate runs,
    the seven others get ALREADY_EXISTS, so does `X`; the bystander finishes with "length" and the
    very tokens it gets alone."""
    stub = scheduler_pb2_grpc.SchedulerStub(scheduler_channel)
    uid = uuid.uuid4().hex[:8]

    def schedule(request_id: str, prompt: list[int], max_tokens: int, n: int = 1) -> scheduler_pb2.ScheduleRequest:
        params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)
        return scheduler_pb2.ScheduleRequest(request_id=request_id, prompt_token_ids=prompt, params=params)

    def generate(request: scheduler_pb2.ScheduleRequest):
        tokens, reasons = {}, {}
        try:
            for delta in stub.Generate(request, timeout=RPC_TIMEOUT_S):
                tokens.setdefault(delta.index, []).extend(delta.token_ids)
                if delta.finish_reason:
                    reasons[delta.index] = delta.finish_reason
        except grpc.RpcError as exc:
            return exc.code()
        return tokens, reasons

    alone = generate(schedule(f"alone-{uid}", [5, 6, 7], 60))
    with ThreadPoolExecutor(10) as pool:
        bystander = pool.submit(generate, schedule(f"bystander-{uid}", [5, 6, 7], 60))
        dups = [pool.submit(generate, schedule(f"dup-{uid}", [10 + i, 11], 20)) for i in range(8)]
        first = stub.Generate(schedule(f"X{uid}#1", [9, 9], 100), timeout=RPC_TIMEOUT_S)
        assert next(first).accepted  # X#1 is live
        assert generate(schedule(f"X{uid}", [4, 4], 20, n=2)) is grpc.StatusCode.ALREADY_EXISTS
        assert sum(1 for _ in first) > 0
        outcomes = [d.result() for d in dups]
        assert bystander.result() == alone and alone[1] == {0: "length"}
    assert sum(1 for o in outcomes if isinstance(o, tuple)) == 1, outcomes
    assert outcomes.count(grpc.StatusCode.ALREADY_EXISTS) == 7, outcomes
    assert_serves_normally(stack)


RESPONSES = {"/pagedserve.v1.Generation/Generate": generate_pb2.GenerateResponse,
             "/pagedserve.v1.Scheduler/Generate": scheduler_pb2.TokenDelta}
REQUESTS = {"/pagedserve.v1.Generation/Generate": generate_pb2.GenerateRequest,
            "/pagedserve.v1.Scheduler/Generate": scheduler_pb2.ScheduleRequest}


def raw_generate(channel: grpc.Channel, method: str):
    """Send raw request bytes; the replies are parsed, so a request that happens to be valid is followed to its end."""
    return channel.unary_stream(method, request_serializer=None, response_deserializer=RESPONSES[method].FromString)


@pytest.mark.parametrize("method,message", [
    ("/pagedserve.v1.Generation/Generate", generate_pb2.GenerateRequest),
    ("/pagedserve.v1.Scheduler/Generate", scheduler_pb2.ScheduleRequest),
])
def test_grpc_generate_random_bytes_that_parse(stack, gateway_channel, scheduler_channel, method, message):
    """Random serialized bytes that decode as the request message (garbage field values)."""
    channel = gateway_channel if "Generation" in method else scheduler_channel
    call = raw_generate(channel, method)
    seen: dict[str, int] = {}

    @FUZZ
    @given(st.binary(max_size=200))
    def check(data):
        try:
            request = message.FromString(data)
        except Exception:
            assume(False)
        if message is scheduler_pb2.ScheduleRequest:
            assume(len(request.prompt_token_ids) < 2000)
        try:
            code = outcome(call(data, metadata=METADATA, timeout=RPC_TIMEOUT_S))
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nbytes: {data!r}\nrequest:\n{describe(request)}") from None
        seen[code] = seen.get(code, 0) + 1

    check()
    print(f"\n{method} random-bytes outcomes: {seen}")
    assert_serves_normally(stack)


def parses(message, data: bytes) -> bool:
    try:
        message.FromString(data)
        return True
    except Exception:  # noqa: BLE001 - DecodeError and friends
        return False


@pytest.mark.parametrize("method", [
    "/pagedserve.v1.Generation/Generate",
    "/pagedserve.v1.Scheduler/Generate",
])
def test_grpc_generate_unparseable_bytes(stack, gateway_channel, scheduler_channel, method):
    """Bytes that are no valid request message (a truncated varint or field, a string that is not
    UTF-8) get INVALID_ARGUMENT naming the parse error, not gRPC's UNKNOWN."""
    channel = gateway_channel if "Generation" in method else scheduler_channel
    call = raw_generate(channel, method)
    candidates = (b"\xff\xff\xff", b"\x0a\x05ab", b"\x12\x02\xc3\x28", b"\x0a\x02\xc3\x28", b"\x1a\x02\xc3\x28")
    broken = [data for data in candidates if not parses(REQUESTS[method], data)]
    assert len(broken) >= 3
    for data in broken:
        with pytest.raises(grpc.RpcError) as err:
            list(call(data, metadata=METADATA, timeout=RPC_TIMEOUT_S))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "does not parse" in err.value.details()
    assert_serves_normally(stack)


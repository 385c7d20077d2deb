"""The gateway's reliability and security: stream resume from another gateway (Last-Event-ID),
graceful drain on SIGTERM, request limits (413, 400 bounds, timeout, tokens in flight, per-key rate),
several API keys, CORS off by default. Pure gateway logic in process; the rest on real processes,
real Redis and a tiny model."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import types

import httpx
import pytest

from pagedserve.common.grpc_util import free_port
from pagedserve.launcher.processes import ServiceProcess
from pagedserve.v1 import generate_pb2
from pagedserve.gateway.app import Cursor, _Skip, build_app
from pagedserve.gateway.backend import Backend
from pagedserve.gateway.limits import Limits, RateLimiter, TokenBucket, parse_rate_limit
from pagedserve.gateway.server import api_keys, drain

KEY = "sk-reliability"


# ---- pure logic ---------------------------------------------------------------------------------
def test_cursor_round_trip():
    c = Cursor(2)
    c.tokens, c.chars, c.done = [12, 7], [45, 30], [True, False]
    assert c.event_id() == "12:45:f,7:30"
    assert Cursor.parse("12:45:f,7:30") == ([12, 7], [45, 30], [True, False])
    assert Cursor.parse("5") == ([5], [None], [False])
    for bad in ("", "x", "1:2:3", "-1:0", "1:2:f:g"):
        with pytest.raises(ValueError):
            Cursor.parse(bad)


def _msg(text: str, ids: list[int], finish: str = "") -> generate_pb2.GenerateResponse:
    return generate_pb2.GenerateResponse(index=0, text=text, token_ids=ids, finish_reason=finish)


def test_skip_cuts_a_replayed_message_at_the_cursor():
    """Live the client got 'Hel' 'lo' (3 tokens, 5 chars); the replay comes as one message."""
    skip = _Skip(None, [3], [5], [False], True)
    cursor = Cursor(1)
    out = asyncio.run(skip.apply(_msg("Hello world", [1, 2, 3, 4, 5]), cursor))
    assert out.text == " world" and list(out.token_ids) == [4, 5]
    cursor.tokens[0], cursor.chars[0] = 5, 11
    nxt = _msg("!", [6], "length")
    assert asyncio.run(skip.apply(nxt, cursor)) is nxt
    # Everything already seen: dropped; the client saw the end: nothing at all.
    assert asyncio.run(_Skip(None, [5], [11], [False], True).apply(_msg("Hello world", [1, 2, 3, 4, 5]),
                                                                    Cursor(1))) is None
    assert asyncio.run(_Skip(None, [6], [12], [True], True).apply(nxt, cursor)) is None


def test_token_bucket_and_rate_limiter():
    bucket = TokenBucket(2.0, 2.0, now=0.0)
    assert bucket.take(0.0) == 0.0 and bucket.take(0.0) == 0.0
    assert bucket.take(0.0) == pytest.approx(0.5)
    assert bucket.take(0.5) == 0.0
    limiter = RateLimiter(1.0, 1.0, max_keys=2)
    a, b = RateLimiter.identity("key-a", None), RateLimiter.identity("key-b", None)
    assert "key-a" not in a  # the key itself is never kept
    assert limiter.check(a, 0.0) == 0.0 and limiter.check(a, 0.0) > 0 and limiter.check(b, 0.0) == 0.0
    limiter.check("c", 0.0)
    assert len(limiter.buckets) == 2
    assert parse_rate_limit("5") == (5.0, 5.0) and parse_rate_limit("0.5:3") == (0.5, 3.0)
    assert parse_rate_limit(None) is None and parse_rate_limit("0") is None
    with pytest.raises(ValueError):
        parse_rate_limit("1:0")


def test_several_api_keys(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text("# team keys\nkey-file-1\n\nkey-file-2\n")
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "key-env-1, key-env-2")
    args = types.SimpleNamespace(api_key=["key-flag"], api_key_file=str(path))
    keys = api_keys(args)
    assert keys == ["key-flag", "key-file-1", "key-file-2", "key-env-1", "key-env-2"]
    backend = Backend("127.0.0.1:1", "127.0.0.1:1", api_key=keys)
    for key in keys:
        assert backend.key_ok(f"Bearer {key}")
    assert not backend.key_ok("Bearer key-flag2") and not backend.key_ok(None) and not backend.key_ok("key-flag")
    assert Backend("a", "b").key_ok(None)  # no keys: open


def _client(backend: Backend) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(backend)), base_url="http://gw")


def test_gate_limits_in_process():
    """413 (Content-Length or chunked), 400 for n and timeout, 429 per key, 503 while draining, CORS off
    by default: all answered by the gateway itself (no service behind it is asked)."""
    async def main():
        backend = Backend("127.0.0.1:1", "127.0.0.1:1", api_key=[KEY, "other"],
                          limits=Limits(max_body_bytes=200, max_n=4, rate_limit=(1.0, 3.0)))
        auth = {"Authorization": f"Bearer {KEY}"}
        async with _client(backend) as http:
            r = await http.post("/v1/completions", json={"prompt": "x" * 300}, headers=auth)
            assert r.status_code == 413 and "max-body-bytes" in r.json()["error"]["message"]

            async def chunks():
                for _ in range(3):
                    yield b"x" * 100
            r = await http.post("/v1/completions", content=chunks(), headers=auth)
            assert r.status_code == 413
            r = await http.post("/v1/completions", json={"prompt": "hi", "n": 5}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "4" in r.json()["error"]["message"]
            # The burst of 3 is spent for this key; another key has its own bucket.
            r = await http.post("/v1/completions", json={"prompt": "hi", "timeout": -1}, headers=auth)
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
            r = await http.post("/v1/completions", json={"prompt": "hi", "timeout": -1},
                                headers={"Authorization": "Bearer other"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "timeout"
            r = await http.options("/v1/models", headers={"Origin": "https://evil.example",
                                                          "Access-Control-Request-Method": "GET"})
            assert "access-control-allow-origin" not in r.headers
            backend.draining = True
            r = await http.get("/v1/models", headers={"Authorization": "Bearer other"})
            assert r.status_code == 503 and r.headers["Retry-After"]
        cors = Backend("a", "b", limits=Limits(cors_origins=["https://ok.example"]))
        async with _client(cors) as http:
            r = await http.options("/v1/models", headers={"Origin": "https://ok.example",
                                                          "Access-Control-Request-Method": "GET"})
            assert r.headers["access-control-allow-origin"] == "https://ok.example"
    asyncio.run(main())


def test_tokens_in_flight_bound():
    backend = Backend("a", "b", limits=Limits(max_tokens_in_flight=100))
    assert backend.reserve_tokens(150)  # alone, a request is always admitted
    assert not backend.reserve_tokens(1)
    backend.release_tokens(150)
    assert backend.reserve_tokens(60) and backend.reserve_tokens(40) and not backend.reserve_tokens(1)


def test_drain_waits_then_aborts():
    class Gen:
        def __init__(self, backend):
            self.backend, self.aborted = backend, False

        def abort_for_shutdown(self):
            self.aborted = True
            self.backend.inflight.discard(self)

    async def main():
        backend = Backend("a", "b")
        quick, stuck = Gen(backend), Gen(backend)
        backend.inflight |= {quick, stuck}
        asyncio.get_running_loop().call_later(0.1, backend.inflight.discard, quick)
        started = time.monotonic()
        assert await drain(backend, 0.5) == 1
        assert backend.draining and stuck.aborted and not quick.aborted
        assert 0.4 < time.monotonic() - started < 3
    asyncio.run(main())


# ---- real processes ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(default_model_path, tmp_path_factory):
    from service_stack import tiny_model_with_tokenizer
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-tok"), default_model_path)


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    from service_stack import start_test_stack
    stack = start_test_stack(tiny_model, tmp_path_factory.mktemp("logs"), api_key=KEY)
    yield stack
    stack.stop()


def extra_gateway(stack, log_dir, *flags: str) -> tuple[ServiceProcess, str]:
    """Another gateway on the same stack (same services, same Redis), on its own ports."""
    base = next(p for p in stack.processes if p.name == "gateway")
    argv, port, grpc_port = list(base.argv), free_port(), free_port()
    argv[argv.index("--port") + 1], argv[argv.index("--grpc-port") + 1] = str(port), str(grpc_port)
    proc = ServiceProcess("gateway", argv + list(flags), f"127.0.0.1:{grpc_port}", env=base.env,
                          log_path=log_dir / f"gateway-{port}.log").start()
    proc.wait_healthy(120)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/v1/models", headers=AUTH, timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the extra gateway never answered"
        time.sleep(0.1)


AUTH = {"Authorization": f"Bearer {KEY}"}


class frozen_worker:
    """SIGSTOP the worker for a while: requests stay in flight (the tiny model is otherwise done
    before a test can act)."""

    def __init__(self, stack) -> None:
        self.worker = next(p for p in stack.processes if p.name == "worker0")

    def __enter__(self):
        self.worker.signal(signal.SIGSTOP)
        return self

    def __exit__(self, *exc) -> None:
        self.worker.signal(signal.SIGCONT)
LONG = {"prompt": "The history of the city", "max_tokens": 160, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}


def read_events(lines, limit: int | None = None):
    """(event id, data dict) pairs from SSE lines, until [DONE] or `limit` events with text."""
    events, event_id, texts = [], None, 0
    for line in lines:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            if line == "data: [DONE]":
                break
            data = json.loads(line[6:])
            events.append((event_id, data))
            texts += bool(data.get("choices") and data["choices"][0].get("text"))
            if limit is not None and texts >= limit:
                break
    return events


def text_of(events) -> str:
    return "".join(c.get("text") or "" for _, d in events for c in d.get("choices", []))


def usage_of(events) -> dict | None:
    return next((d["usage"] for _, d in reversed(events) if d.get("usage")), None)


@pytest.mark.slow
def test_resume_from_another_gateway_after_kill_9(stack, tmp_path):
    from service_stack import wait_until_idle
    with httpx.Client(timeout=120) as http:
        whole = http.post(stack.http_url + "/v1/completions", json={**LONG, "stream": False}, headers=AUTH).json()
    reference = whole["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] == 160 and reference

    gw_a, url_a = extra_gateway(stack, tmp_path)
    gw_b, url_b = extra_gateway(stack, tmp_path)
    try:
        with httpx.Client(timeout=120) as http, http.stream("POST", url_a + "/v1/completions", json=LONG,
                                                            headers=AUTH) as first:
            request_id = first.headers["x-request-id"]
            got = read_events(first.iter_lines(), limit=20)
            gw_a.signal(signal.SIGKILL)
            gw_a.proc.wait(10)
        last_id = got[-1][0]
        tokens = int(last_id.split(":")[0])
        assert 0 < tokens < 160
        started = time.monotonic()
        with httpx.Client(timeout=120) as http, http.stream(
                "GET", f"{url_b}/v1/requests/{request_id}/stream", headers={**AUTH, "Last-Event-ID": last_id}) as rest:
            assert rest.status_code == 200, rest.read()
            lines = rest.iter_lines()
            resumed = read_events(lines, limit=1)
            latency = time.monotonic() - started
            resumed += read_events(lines)
        print(f"resume latency (request to first new text): {latency * 1000:.0f} ms after {tokens} tokens")
        assert text_of(got) + text_of(resumed) == reference
        assert usage_of(resumed)["completion_tokens"] == 160
        ids = [int(e.split(":")[0]) for e, d in resumed if d.get("choices")]
        assert ids == sorted(ids) and ids[0] > tokens and ids[-1] == 160
        # ?after=N (tokens) from the start gives the whole text too.
        with httpx.Client(timeout=120) as http:
            r = http.get(f"{url_b}/v1/requests/{request_id}/stream?after=0", headers=AUTH)
        assert text_of(read_events(r.text.splitlines())) == reference
        assert wait_until_idle(stack).num_running == 0
    finally:
        gw_a.stop()
        gw_b.stop()


@pytest.mark.slow
def test_sigterm_drains_streams_and_refuses_new_requests(stack, tmp_path):
    gw, url = extra_gateway(stack, tmp_path, "--shutdown-timeout", "60")
    body = {**LONG, "max_tokens": 600}
    results: list = []

    started = threading.Barrier(3)

    def run_stream():
        with httpx.Client(timeout=120) as http, http.stream("POST", url + "/v1/completions", json=body,
                                                            headers=AUTH) as r:
            lines = r.iter_lines()
            got = read_events(lines, limit=1)
            started.wait(60)
            results.append(got + read_events(lines))

    threads = [threading.Thread(target=run_stream) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        started.wait(60)  # both streams have text
        with frozen_worker(stack):  # ... and stay in flight while the worker is frozen
            gw.signal(signal.SIGTERM)
            time.sleep(0.5)
            refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH,
                                 timeout=10)
            assert refused.status_code == 503 and refused.headers["Retry-After"]
            assert gw.alive()
        for t in threads:
            t.join(120)
        assert len(results) == 2
        for events in results:
            assert usage_of(events)["completion_tokens"] == 600
            assert any(c.get("finish_reason") == "length" for _, d in events for c in d.get("choices", []))
        assert gw.proc.wait(30) == 0
    finally:
        gw.stop()


@pytest.mark.slow
def test_shutdown_timeout_aborts_the_rest_and_frees_blocks(stack, tmp_path):
    from service_stack import wait_until_idle
    gw, url = extra_gateway(stack, tmp_path, "--shutdown-timeout", "0.5")
    try:
        with httpx.Client(timeout=120) as http, http.stream("POST", url + "/v1/completions",
                                                            json={**LONG, "max_tokens": 800}, headers=AUTH) as r:
            lines = r.iter_lines()
            events = read_events(lines, limit=1)
            gw.signal(signal.SIGTERM)
            events += read_events(lines)
        reasons = [c.get("finish_reason") for _, d in events for c in d.get("choices", []) if c.get("finish_reason")]
        assert reasons == ["abort"]
        assert any(d.get("error", {}).get("code") == "server_shutdown" for _, d in events)
        assert gw.proc.wait(30) == 0
        stats = wait_until_idle(stack)
        assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    finally:
        gw.stop()


@pytest.mark.slow
def test_limits_on_a_real_stack(stack, tmp_path):
    from service_stack import wait_until_idle
    gw, url = extra_gateway(stack, tmp_path, "--max-tokens-in-flight", "900", "--max-body-bytes", "4096")
    try:
        with httpx.Client(timeout=120) as http:
            # A deadline: the request is aborted when it passes, and its blocks are freed.
            started = time.monotonic()
            r = http.post(url + "/v1/completions", json={**LONG, "stream": False, "max_tokens": 900, "timeout": 0.5},
                          headers=AUTH)
            assert r.status_code == 504 and "timeout" in r.json()["error"]["message"], r.text
            assert time.monotonic() - started < 10
            stats = wait_until_idle(stack)
            assert stats.num_running == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks
            with http.stream("POST", url + "/v1/completions", json={**LONG, "max_tokens": 900, "timeout": 0.5},
                             headers=AUTH) as s:
                events = read_events(s.iter_lines())
            assert events[-1][1]["error"]["code"] == "deadline_exceeded" and "timeout" in events[-1][1]["error"][
                "message"]
            stats = wait_until_idle(stack)
            assert stats.num_running == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks
            # Tokens in flight: one long stream holds ~700; a second is refused with 429.
            # (The worker is frozen: the first stream is accepted, answered 200, and makes no progress.)
            frozen = frozen_worker(stack).__enter__()
            try:
                with http.stream("POST", url + "/v1/completions", json={**LONG, "max_tokens": 700},
                                 headers=AUTH) as s:
                    assert s.status_code == 200
                    r = http.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 300}, headers=AUTH)
                    assert r.status_code == 429 and r.headers["Retry-After"], r.text
                    assert "max-tokens-in-flight" in r.json()["error"]["message"]
                    frozen.__exit__()
                    assert usage_of(read_events(s.iter_lines()))["completion_tokens"] == 700
            finally:
                frozen.__exit__()
            r = http.post(url + "/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 1}, headers=AUTH)
            assert r.status_code == 413
            r = http.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 100000}, headers=AUTH)
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            assert wait_until_idle(stack).num_running == 0
        log_text = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
        assert KEY not in log_text and "The history of the city" not in log_text
    finally:
        gw.stop()

"""The gateway's reliability and security logic in process, no service behind it: the resume
cursor (Last-Event-ID) and the replay cut at it, the token-bucket rate limiter, several API keys,
request limits (413, 400 bounds, 429 per key, 503 while draining, tokens in flight), CORS off by
default, and the drain. The same on real processes: tests/stack/test_reliability_gateway.py."""

from __future__ import annotations

import asyncio
import time
import types

import httpx
import pytest

from pagedserve.v1 import generate_pb2
from pagedserve.gateway.app import Cursor, _Skip, build_app
from pagedserve.gateway.backend import Backend
from pagedserve.gateway.limits import Limits, RateLimiter, TokenBucket, parse_origins, parse_rate_limit
from pagedserve.gateway.server import api_keys, drain

KEY = "sk-reliability"


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


def test_cors_origins_as_a_list_or_vllms_json_and_the_docs_switch():
    assert parse_origins("https://a.example, https://b.example") == ["https://a.example", "https://b.example"]
    assert parse_origins('["https://a.example", "*"]') == ["https://a.example", "*"]  # vLLM's --allowed-origins
    assert parse_origins("") == [] and parse_origins(None) == []
    with pytest.raises(ValueError, match="JSON list"):
        parse_origins('["https://a.example", 3]')

    async def main():
        for docs in (True, False):  # --disable-fastapi-docs (vLLM's): no description at all
            async with _client(Backend("a", "b", limits=Limits(api_docs=docs))) as http:
                r = await http.get("/openapi.json")
                assert r.status_code == (200 if docs else 404)
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


def test_a_batch_counts_as_its_prompts_against_the_keys_limits():
    """Issue 42 row 2: a list of prompts was admitted as one request and became up to 256 requests
    (x n sequences), each checked alone. Now, before any prompt is sent: at most 256 sequences
    (prompts x n) in one request, one request per prompt off the key's rate bucket (all or none),
    and the batch's output budget within --max-tokens-in-flight."""
    async def main():
        backend = Backend("127.0.0.1:1", "127.0.0.1:1", api_key=[KEY, "other"],
                          limits=Limits(rate_limit=(0.01, 10.0), max_tokens_in_flight=100))
        auth = {"Authorization": f"Bearer {KEY}"}
        async with _client(backend) as http:
            r = await http.post("/v1/completions", json={"prompt": ["hi"] * 256, "n": 16}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "4096" in r.text, r.text
            r = await http.post("/v1/completions", json={"prompt": ["hi"] * 10}, headers=auth)
            assert r.status_code == 429 and "counts as 10" in r.json()["error"]["message"], r.text
            # Refused whole: the bucket holds 8 (the gate takes one for every request it lets in).
            r = await http.post("/v1/completions", json={"prompt": ["hi"] * 5, "max_tokens": 4}, headers=auth)
            assert r.status_code != 429, r.text  # past admission (no tokenizer here: an error downstream)
            r = await http.post("/v1/completions", json={"prompt": ["hi"] * 4}, headers=auth)
            assert r.status_code == 429, r.text  # 2 left after 1 + 5, then 1 at the gate
            backend.admission.tokens_in_flight = 50
            r = await http.post("/v1/completions", json={"prompt": ["hi"] * 4, "n": 2, "max_tokens": 10},
                                headers={"Authorization": "Bearer other"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_tokens_in_flight", r.text

    asyncio.run(main())

"""The gateway's reliability on real processes, real Redis and a tiny model: stream resume from
another gateway (Last-Event-ID) after kill -9, graceful drain on SIGTERM, the shutdown timeout,
request limits (timeout, tokens in flight, body size, max_tokens). The pure gateway logic is tested
in process in tests/test_gateway_resume_and_limits.py."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from pagedserve.launcher.processes import ServiceProcess
import service_stack
from service_stack import wait_until_idle

KEY = "sk-reliability"


@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    return launch_stack(tiny_model, api_key=KEY)


AUTH = {"Authorization": f"Bearer {KEY}"}


def extra_gateway(stack, log_dir, *flags: str) -> tuple[ServiceProcess, str]:
    return service_stack.extra_gateway(stack, log_dir, AUTH, *flags)


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
        "stream": True, "stream_options": {"include_usage": True, "include_event_ids": True}}


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
            # Held until after the kill: dropping the iterator would close the connection, and a
            # client that leaves aborts its request (if gateway A saw that before it died).
            lines = first.iter_lines()
            got = read_events(lines, limit=20)
            gw_a.signal(signal.SIGKILL)
            gw_a.proc.wait(10)
            del lines
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
def test_shutdown_timeout_stops_a_beam_search(stack, tmp_path):
    """A beam search is a run of steps at the gateway: past --shutdown-timeout it takes no further one
    and answers 503 server_shutdown; the gateway exits and no block is left held."""
    gw, url = extra_gateway(stack, tmp_path, "--shutdown-timeout", "0.5")
    replies: list = []
    body = {**LONG, "stream": False, "max_tokens": 400, "n": 4, "use_beam_search": True}
    try:
        thread = threading.Thread(target=lambda: replies.append(
            httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)))
        thread.start()
        time.sleep(2.0)  # a few steps in (400 steps of 4 beams take far longer)
        gw.signal(signal.SIGTERM)
        thread.join(60)
        (reply,) = replies
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "server_shutdown", reply.text
        assert gw.proc.wait(30) == 0
        stats = wait_until_idle(stack)
        assert stats.num_running == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks
    finally:
        gw.stop()


@pytest.mark.slow
def test_limits_on_a_real_stack(stack, tmp_path):
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


@pytest.mark.slow
def test_a_keys_rate_limit_holds_for_all_gateways_together(stack, tmp_path):
    """Two gateways with --rate-limit on one Redis (as Helm runs them): the key's burst is spent across both,
    and each refuses the next request with 429 and a Retry-After of about the refill time."""
    gw_a, url_a = extra_gateway(stack, tmp_path, "--rate-limit", "0.01:3")
    gw_b, url_b = extra_gateway(stack, tmp_path, "--rate-limit", "0.01:3")
    try:
        with httpx.Client(timeout=60) as http:
            # the gateways' start-up checks took requests off the key's bucket: what is left goes through A
            codes = [http.get(url_a + "/v1/models", headers=AUTH).status_code for _ in range(3)]
            assert codes[-1] == 429 and set(codes) <= {200, 429}, codes
            r = http.get(url_b + "/v1/models", headers=AUTH)  # B's own share would be 2 or 3 of 3
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 50, r.text
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        gw_a.stop()
        gw_b.stop()

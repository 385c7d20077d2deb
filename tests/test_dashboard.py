"""The live dashboard (/dashboard): served by the gateway app with its script and style sheet;
drawn by Debian's headless chromium from a stats fixture (every panel, a prefix-mounted copy, a
stats object with most fields missing, a refused API key). From the real services with requests in
flight: tests/stack/test_dashboard_stack.py."""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Header, HTTPException
from fastapi.testclient import TestClient

from dashboard_page import chromium, dump_dom, queue_count, queue_ids
from pagedserve.common.grpc_util import free_port
from pagedserve.gateway import dashboard

KEY = "sk-dashboard-test"


def test_without_chromium_the_tests_fail_saying_make_installs_it(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match="`make` installs it"):
        chromium()


# ---- the page served by the gateway (no browser) -------------------------------------------------

def test_gateway_serves_the_dashboard():
    from pagedserve.gateway.app import build_app
    from pagedserve.gateway.backend import Backend

    app = build_app(Backend("127.0.0.1:9", "127.0.0.1:9", api_key=KEY))
    client = TestClient(app)
    page = client.get("/dashboard")  # the page itself is open; its fetches carry #key= as a bearer token
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "default-src 'none'" in csp
    assert page.headers["referrer-policy"] == "no-referrer" and page.headers["x-frame-options"] == "DENY"
    assert 'src="dashboard/static/dashboard.js"' in page.text
    assert 'href="dashboard/static/dashboard.css"' in page.text
    for name, media in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css"),
                        ("dashboard.html", "text/html")):
        reply = client.get(f"/dashboard/static/{name}")
        assert reply.status_code == 200, name
        assert reply.headers["content-type"].startswith(media)
        assert reply.content == (Path(dashboard.__file__).parent / "static" / name).read_bytes()
        # nothing is fetched from elsewhere at run time (the SVG namespace is a name, not a fetch)
        assert not re.search(r"(src|href)=[\"']?(https?:)?//", reply.text), name
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", reply.text), name
    assert "v1/engine/stats" in client.get("/dashboard/static/dashboard.js").text
    assert client.get("/dashboard/static/nope.js").status_code == 404
    assert client.get("/dashboard/static/..%2Fdashboard.py").status_code == 404
    assert client.get("/v1/engine/stats").status_code == 401  # the data stays behind the key


# ---- the page drawn from fixtures ---------------------------------------------------------------

def fixture_stats() -> dict:
    """256 blocks, four running requests (one shares three blocks with another), cached blocks,
    120 steps with prefill bursts and two preemptions, eight finished requests."""
    rng = random.Random(5)
    t0, n = 1_760_000_000.0, 256
    states, tables = ["."] * n, {}
    free = list(range(n))
    rng.shuffle(free)
    for rid, count in (("cmpl-a1b2c3d4e5f6a7b8", 31), ("cmpl-0f9e8d7c6b5a4f3e", 24), ("cmpl-1234abcd5678ef90", 18),
                       ("cmpl-feedbeefcafe0123", 9)):
        tables[rid] = [free.pop() for _ in range(count)]
        for block in tables[rid]:
            states[block] = "u"
    tables["cmpl-feedbeefcafe0123"] = tables["cmpl-a1b2c3d4e5f6a7b8"][:3] + tables["cmpl-feedbeefcafe0123"]
    for _ in range(20):
        states[free.pop()] = "c"
    steps = []
    for k in range(120):
        prefill = 480 if k % 17 == 0 else 200 if k % 23 == 3 else 0
        steps.append({"step": 1000 + k, "time": t0 + 0.03 * k, "duration_s": 0.012 + 0.004 * (prefill > 0),
                      "scheduled_tokens": prefill + 4, "prefill_tokens": prefill, "decode_tokens": 4,
                      "num_seqs": 4 + (prefill > 0), "token_budget": 512, "seq_budget": 8, "blocks_used": 80 + k // 4,
                      "blocks_cached": 20, "blocks_free": 156 - k // 4, "preemptions": int(k in (40, 90)),
                      "waiting": 2 * (k > 100),
                      "waiting_reasons": {"no_blocks": int(k > 100), "seq_budget": int(k > 100), "token_budget": 0}})
    recent = []
    for i in range(8):
        g = t0 - 10 + 1.1 * i
        tr, sr = g + 0.0012, g + 0.0052
        fs = sr + 0.002 + 0.05 * (i % 3)
        ft, fts = fs + 0.02, fs + 0.022
        fin = fts + 0.8 + 0.3 * (i % 4)
        recent.append({"request_id": f"cmpl-{i:04x}deadbeef{i:04x}", "prompt_tokens": 40 + 7 * i,
                       "output_tokens": 200 + 30 * i, "finish_reason": "length", "cached_tokens": 16 * (i % 2),
                       "prefill_chunk_list": [{"time": fs, "tokens": 32}, {"time": fs + 0.01, "tokens": 8 + 7 * i}],
                       "timings": {
                           "gateway_received": g, "tokenizer_received": tr, "tokenized": tr + 0.003,
                           "scheduler_received": sr, "first_scheduled": fs, "first_token": ft,
                           "first_token_streamed": fts, "finished": fin, "ttft_ms": 1000 * (fts - g),
                           "ttft_breakdown_ms": {"gateway": 1000 * (tr - g), "tokenizer": 1000 * (sr - tr),
                                                 "queue": 1000 * (fs - sr), "prefill": 1000 * (ft - fs),
                                                 "network": 1000 * (fts - ft)}}})
    return {"time": t0 + 4,
            "config": {"max_num_batched_tokens": 512, "max_num_seqs": 8, "block_size": 16, "num_gpu_blocks": n,
                       "max_model_len": 1024},
            "queues": {"waiting": ["cmpl-waiting0001", "cmpl-waiting0002"], "running": list(tables), "swapped": []},
            "queue_lengths": {"waiting": 5, "running": 4, "swapped": 0},  # the id lists may be cut short
            "kv": {"num_blocks": n, "states": "".join(states), "tables": tables}, "steps": steps,
            "recent_requests": recent,
            "totals": {"num_preemptions": 2, "prefix_cache_queries": 40, "prefix_cache_hits": 23, "num_steps": 1120,
                       "prompt_tokens": 9000, "generation_tokens": 31000,
                       "waiting_reasons": {"no_blocks": 30, "seq_budget": 12, "token_budget": 4}}}


SPARSE = {"time": 1_760_000_000.0, "kv": {"states": ".uc."}, "queues": {"running": ["r1"]},
          "steps": [{"step": 1}], "recent_requests": [{"request_id": "r0", "timings": {}}]}


class FixtureServer:
    """The dashboard router beside a fake /v1/engine/stats: at / (the full fixture, behind KEY),
    and mounted under /sparse/ (most fields missing, no key), on uvicorn in a thread."""

    def __init__(self) -> None:
        self.full, self.asked = fixture_stats(), []
        app = FastAPI()
        app.include_router(dashboard.router)
        app.include_router(dashboard.router, prefix="/sparse")

        @app.get("/v1/engine/stats")
        async def stats(steps: int = 0, authorization: str = Header("")) -> dict:
            self.asked.append(steps)
            if authorization != f"Bearer {KEY}":
                raise HTTPException(401, "Incorrect or missing API key")
            return self.full

        @app.get("/sparse/v1/engine/stats")
        async def sparse() -> dict:
            return SPARSE

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
        self.thread = threading.Thread(target=asyncio.run, args=(self.server.serve(),), daemon=True)
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            assert time.time() < deadline, "the fixture server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.config.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def fixture_server():
    server = FixtureServer()
    yield server
    server.close()


def test_page_draws_every_panel_from_the_stats(fixture_server):
    data = fixture_server.full
    dom = dump_dom(f"{fixture_server.url}/dashboard#key={KEY}")
    assert dom.by_id("status-text").text.startswith("live"), dom.by_id("status-text").text
    assert len(fixture_server.asked) >= 2 and all(s > 0 for s in fixture_server.asked)  # it polls, asking for steps

    cells = dom.by_id("kv-grid").all(cls="kv-cell")
    assert [int(c.attrs["data-block"]) for c in cells] == list(range(256))
    states = data["kv"]["states"]
    for cell, state in zip(cells, states):
        expected = {"u": "used", "c": "cached", ".": "free"}[state]
        assert expected in cell.classes, (cell.attrs, state)
        assert f"block {cell.attrs['data-block']}" in cell.attrs["title"]
    owner = {}
    for rid, blocks in data["kv"]["tables"].items():
        for block in blocks:
            owner.setdefault(block, rid)
    used = [c for c in cells if "used" in c.classes]
    assert len(used) == states.count("u")
    for cell in used:
        block = int(cell.attrs["data-block"])
        assert cell.attrs["data-request"] == owner[block]
        assert owner[block] in cell.attrs["title"]
        assert "background" in cell.attrs.get("style", "")  # the request's own color
    shared = [c for c in cells if "shared" in c.classes]
    assert len(shared) == 3 and all("shared by" in c.attrs["title"] for c in shared)
    assert "free 154" in dom.by_id("kv-legend").text and "cached (reusable) 20" in dom.by_id("kv-legend").text

    assert queue_ids(dom, "running") == data["queues"]["running"]
    assert queue_ids(dom, "waiting") == data["queues"]["waiting"]
    assert (queue_count(dom, "running"), queue_count(dom, "waiting"), queue_count(dom, "swapped")) == (4, 5, 0)
    assert dom.by_id("queue-waiting").all("li", "more")[0].text == "+3 more"
    reasons = dom.by_id("waiting-reasons").all("tr")
    assert [r.all("td")[0].text for r in reasons[1:]] == ["no free KV blocks", "sequence budget full",
                                                          "token budget full"]
    assert [r.all("td")[2].text for r in reasons[1:]] == ["30", "12", "4"]

    budget = dom.by_id("budget-chart")
    assert {"series-tokens", "series-seqs", "series-kv"} <= {c for p in budget.all("polyline") for c in p.classes}
    assert len(budget.all("g", "preemption")) == 2
    tokens = dom.by_id("tokens-chart")
    assert len(tokens.all("rect", "prefill")) == sum(1 for s in data["steps"] if s["prefill_tokens"])
    assert len(tokens.all("rect", "decode")) == 120

    rows = dom.by_id("waterfall-body").all("g", "waterfall-row")
    assert [r.attrs["data-request"] for r in rows] == [r["request_id"] for r in data["recent_requests"]]
    for row in rows:
        stages = [next(c for c in rect.classes if c.startswith("stage-")) for rect in row.all("rect", "stage")]
        assert stages == ["stage-gateway", "stage-tokenizer", "stage-queue", "stage-prefill", "stage-network",
                          "stage-decode"]
        xs = [float(rect.attrs["x"]) for rect in row.all("rect", "stage")]
        assert xs == sorted(xs)  # one after the other on the common axis
        assert len(row.all("line", "chunk-mark")) == 2 and len(row.all("line", "ttft-mark")) == 1

    headline = dom.by_id("headline-numbers").text
    assert "57.5%" in headline and "cache hits" in headline  # 23 of 40
    assert "31.0k" in headline and "1120" in headline


def test_page_under_a_path_prefix_with_fields_missing(fixture_server):
    dom = dump_dom(f"{fixture_server.url}/sparse/dashboard")
    assert dom.by_id("status-text").text.startswith("live"), dom.by_id("status-text").text
    cells = dom.by_id("kv-grid").all(cls="kv-cell")
    assert [sorted(c.classes - {"kv-cell"}) for c in cells] == [["free"], ["used"], ["cached"], ["free"]]
    assert queue_ids(dom, "running") == ["r1"] and queue_count(dom, "swapped") == 0
    assert len(dom.by_id("waterfall-body").all("g", "waterfall-row")) == 1


def test_page_says_when_the_key_is_refused(fixture_server):
    dom = dump_dom(f"{fixture_server.url}/dashboard#key=wrong", budget_ms=1500)
    status = dom.by_id("status-text").text
    assert "stats unavailable" in status and "401" in status, status
    assert not dom.by_id("kv-grid").all(cls="kv-cell")

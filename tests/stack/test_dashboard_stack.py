"""The live dashboard drawn from the real services with requests in flight: the KV grid shows cells
in use by running requests, the queues list them, the waterfall has a row per finished request, and
a screenshot is saved as a test artifact. From a stats fixture: tests/test_dashboard.py."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from dashboard_page import check_png, chromium, dump_dom, queue_count, queue_ids, screenshot
from service_stack import start_test_stack

KEY = "sk-dashboard-test"
ARTIFACTS = Path(os.environ.get("PAGEDSERVE_TEST_ARTIFACTS") or Path(__file__).parent.parent / "artifacts")



# every client's prompts start alike (four 16-token blocks or so): the prefix cache has something to share
SHARED_PREFIX = ("You are watching the pagedserve dashboard test. Its clients keep long completions in flight "
                 "so that the KV cache grid, the queues and the step charts have something to show.")


class Load:
    """Threads that keep long streaming completions in flight, one after another, until stopped."""

    def __init__(self, url: str, threads: int, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.stop, self.errors = threading.Event(), []
        self.streaming = [threading.Event() for _ in range(threads)]
        self.finished: list[str] = []  # ids of the completions that ran to their end
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def _run(self, index: int) -> None:
        body = {"prompt": SHARED_PREFIX + f" Client {index}: count slowly from one to a thousand.",
                "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        try:
            with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
                while not self.stop.is_set():
                    request_id = None
                    with http.stream("POST", self.url + "/v1/completions", json=body) as reply:
                        assert reply.status_code == 200, reply.read()
                        for line in reply.iter_lines():
                            if line.startswith("data: {") and request_id is None:
                                request_id = json.loads(line[6:])["id"]
                                with self.lock:
                                    self.seen.add(request_id)
                                self.streaming[index].set()
                            if self.stop.is_set():
                                return  # leaving the block closes the stream: the gateway cancels it
                    with self.lock:
                        self.finished.append(request_id)
        except Exception as exc:  # reported by close()
            self.errors.append(exc)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        assert not self.errors, self.errors


@pytest.mark.slow
def test_dashboard_on_the_real_services(tiny_model, tmp_path_factory):
    chromium()  # fail before starting anything when it is missing
    # 2 MiB of KV cache: 256 blocks of 16 tokens on the tiny model (2 layers, 2 KV heads of 16, float32);
    # six clients for four sequence slots: two of them wait
    stack = start_test_stack(tiny_model, tmp_path_factory.mktemp("logs"), api_key=KEY, kv_cache_memory="2MiB",
                             max_num_seqs=4, max_num_batched_tokens=128)
    load = None
    try:
        url = stack.http_url
        auth = {"Authorization": f"Bearer {KEY}"}
        done = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                          json={"prompt": "a short one first", "max_tokens": 8, "ignore_eos": True})
        assert done.status_code == 200, done.text
        load = Load(url, threads=6, max_tokens=160)
        deadline = time.monotonic() + 60
        while len(load.finished) < 3 or sum(e.is_set() for e in load.streaming) < 4:  # some done, more in flight
            assert time.monotonic() < deadline and not load.errors, (load.finished, load.errors)
            time.sleep(0.1)
        stats = httpx.get(url + "/v1/engine/stats", headers=auth, timeout=10).json()
        assert stats["kv"]["tables"] and "u" in stats["kv"]["states"], stats["kv"]  # the endpoint has what to draw

        page = f"{url}/dashboard#key={KEY}"
        dom = dump_dom(page)
        assert dom.by_id("status-text").text.startswith("live"), dom.by_id("status-text").text
        cells = dom.by_id("kv-grid").all(cls="kv-cell")
        assert len(cells) == stats["kv"]["num_blocks"] == stats["config"]["num_gpu_blocks"]
        used = [c for c in cells if "used" in c.classes and c.attrs.get("data-request")]
        assert used, "no KV cell in use by a request"
        running = queue_ids(dom, "running")
        assert running and queue_count(dom, "running") == len(running)
        assert {c.attrs["data-request"] for c in used} <= set(running)  # the grid's owners are running requests
        for name in ("waiting", "swapped"):
            dom.by_id(f"queue-{name}")
        # a row per finished request (the first one, a short one, and those of the load that ran to their end)
        rows = {r.attrs["data-request"]: r for r in dom.by_id("waterfall-body").all("g", "waterfall-row")}
        with load.lock:
            finished = {done.json()["id"], *load.finished}
            seen = finished | load.seen
        assert rows and set(rows) <= seen, (set(rows), seen)
        assert set(rows) & finished
        stages = {rid: {c for rect in row.all("rect", "stage") for c in rect.classes} for rid, row in rows.items()}
        assert all({"stage-queue", "stage-prefill"} <= s for s in stages.values()), stages
        # A decode bar starts after the first token reached the client: a short request whose first
        # token was sent late on a loaded machine (or with its body, unstreamed) may have none.
        assert any("stage-decode" in s for s in stages.values()), stages
        assert dom.by_id("budget-chart").all("polyline", "series-tokens")

        shot = screenshot(page, ARTIFACTS / "dashboard.png")
        check_png(shot, 1400, 1000)
    finally:
        try:
            if load is not None:
                load.close()
        finally:
            stack.stop()

"""A worker whose KV budget holds no block fails its own startup, naming the numbers, and the
launcher shows that message before any other service has started to wait on the worker (on the
H200 the scheduler died instead, after the worker had come up: issue 36). A real launcher, a real
worker process, on the CPU: --kv-cache-memory below one block is the CPU's way to such a budget."""

from __future__ import annotations

import pytest

from pagedserve.common.grpc_util import free_port
from pagedserve.launcher.processes import ServiceError, StackConfig, start_stack


def test_a_budget_without_a_block_stops_the_stack_at_the_worker(tiny_llama, tmp_path):
    cfg = StackConfig(model=str(tiny_llama), device="cpu", dtype="float32", quantization="none",
                      kv_cache_memory="1KiB", port=free_port(), grpc_port=free_port(), redis_url="memory",
                      startup_timeout=120.0, log_dir=str(tmp_path))
    with pytest.raises(ServiceError) as caught:
        start_stack(cfg)
    text = str(caught.value)
    assert text.startswith("worker0 exited before it became healthy"), text
    assert "the KV cache budget of 1024 bytes holds no block" in text and "raise --kv-cache-memory" in text, text
    # the worker was the first service started: no scheduler ever waited on it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker0.log"]

"""The model setup on a real GPU (skipped without CUDA; the GPU kit's e2e stage runs it, gpu/check.sh):
the memory reading behind the KV budget, and a worker that finds the GPU held by another process
failing its own startup with the numbers (what the H200 showed, issue 36: the scheduler died on a
negative budget instead). The arithmetic itself: tests/test_device_memory.py, on any machine."""

from __future__ import annotations

import pytest
import torch

from tiny_models import NO_TOKENIZER

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_memory_reading_of_a_loaded_model(tiny_llama):
    from pagedserve.worker.device_memory import kv_budget
    from pagedserve.worker.model_setup import KVSettings, load_runner, measure_cuda_memory, place_model, size_kv_cache

    place = place_model(str(tiny_llama), "cuda", "float32", None, tokenizer=NO_TOKENIZER)
    assert place.device == torch.device("cuda:0")
    runner = load_runner(place, 16, "none", progress=False)
    reading = measure_cuda_memory(runner, 256)
    free, total = torch.cuda.mem_get_info(place.device)
    assert reading.total == total and 0 < reading.free <= total
    assert reading.weights >= runner.weight_bytes() > 0  # with the buffers beside them
    assert reading.peak > 0  # the profile run allocated activations above the weights
    assert reading.own >= reading.weights  # torch's reservation holds the weights
    # a share that fits beside whatever else this GPU holds
    utilization = min(0.5, int(1000 * (reading.free + reading.weights) / total) / 1000 - 0.01)
    size = size_kv_cache(runner, KVSettings(16, None, utilization, 256), reading)
    assert size.num_blocks == kv_budget(reading, utilization, size.block_bytes) // size.block_bytes > 0
    runner.allocate_kv_cache(size.num_blocks)  # and the pool it sized does allocate
    del runner
    torch.cuda.empty_cache()


def test_a_worker_on_a_gpu_another_process_holds_fails_its_startup(tiny_llama, tmp_path):
    from pagedserve.common.grpc_util import free_port
    from pagedserve.launcher.processes import ServiceError, StackConfig, start_stack

    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(max(0, free - 2 * 2**30), dtype=torch.uint8, device="cuda")  # leave the worker 2 GiB
    try:
        cfg = StackConfig(model=str(tiny_llama), device="cuda", dtype="float32", quantization="none",
                          port=free_port(), grpc_port=free_port(), redis_url="memory", startup_timeout=300.0,
                          log_dir=str(tmp_path))
        with pytest.raises(ServiceError) as caught:
            start_stack(cfg)
    finally:
        del hog
        torch.cuda.empty_cache()
    text = str(caught.value)
    assert text.startswith("worker0 exited before it became healthy"), text
    assert "does not fit in what is free on the GPU" in text and "held by others" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker0.log"]  # no scheduler waited on it

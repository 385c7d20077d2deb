"""worker/device_memory.py: a rank's device and the KV budget on a GPU, as numbers (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve.worker.device_memory import (KVBudgetError, MemoryReading, graph_reserve, kv_budget, local_rank,
                                             num_blocks, physical_device, rank_device, visible_devices)

GiB = 2**30
H200 = 140 * GiB
BLOCK = 2 * 2**20  # a 2 MiB KV block


# ---- a rank's device -------------------------------------------------------------------------------
def test_rank_r_takes_cuda_local_rank():
    assert [rank_device("cuda", r, 4) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert rank_device("cpu", 3, 0) == "cpu"  # CPU ranks share the host


def test_visible_devices_are_indexed_from_zero():
    env = {"CUDA_VISIBLE_DEVICES": "2, 3"}
    visible = visible_devices(env)
    assert visible == ["2", "3"]
    # torch renumbers the visible devices: rank 1 takes cuda:1, which is physical GPU 3
    assert rank_device("cuda", 1, 2, visible) == "cuda:1"
    assert physical_device(1, visible) == "3"
    assert physical_device(1, None) == "1"
    assert visible_devices({}) is None
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_a_rank_beyond_the_visible_gpus_is_named():
    with pytest.raises(ValueError, match=r"local rank 2 needs a GPU at index 2, but torch sees 2 GPU\(s\) "
                                         r"\(CUDA_VISIBLE_DEVICES='4,5'\)"):
        rank_device("cuda", 2, 2, ["4", "5"])
    with pytest.raises(ValueError, match=r"torch sees 1 GPU\(s\) \(every device\)"):
        rank_device("cuda", 1, 1)


def test_local_rank_comes_from_the_environment_when_set():
    assert local_rank(3, {}) == 3
    assert local_rank(3, {"LOCAL_RANK": "0"}) == 0  # one GPU shown to each rank (the Helm chart)
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        local_rank(0, {"LOCAL_RANK": "x"})


# ---- the KV budget ----------------------------------------------------------------------------------
def reading(free: int, weights: int = 3 * GiB, peak: int = 1 * GiB) -> MemoryReading:
    """A device where this process holds its weights (free was read after they were loaded)."""
    return MemoryReading(total=H200, free=free, weights=weights, peak=peak, own=weights)


def test_the_budget_is_the_share_less_weights_and_peak():
    # alone on the device: free = total - weights - a CUDA context of half a GiB
    r = reading(free=H200 - 3 * GiB - GiB // 2)
    assert kv_budget(r, 0.9, BLOCK) == int(0.9 * H200) - 3 * GiB - GiB
    assert kv_budget(r, 0.5, BLOCK) == int(0.5 * H200) - 4 * GiB
    assert r.held_by_others == GiB // 2
    assert num_blocks(kv_budget(r, 0.9, BLOCK), BLOCK) == (int(0.9 * H200) - 4 * GiB) // BLOCK


def test_a_budget_that_holds_no_block_names_its_numbers():
    r = MemoryReading(total=8 * GiB, free=4 * GiB, weights=3 * GiB, peak=GiB, own=3 * GiB)
    with pytest.raises(KVBudgetError) as caught:
        kv_budget(r, 0.5, BLOCK)  # 4 GiB share - 3 GiB weights - 1 GiB peak = 0
    text = str(caught.value)
    for part in ("holds no block", "budget of 0 bytes", "total 8.00 GiB", "free 4.00 GiB", "held by others 1.00 GiB",
                 "weights 3.00 GiB", "activation peak 1.00 GiB", "--gpu-memory-utilization 0.5",
                 f"block {BLOCK} bytes"):
        assert part in text, (part, text)


def test_another_process_holding_the_gpu_is_an_error_not_a_negative_budget():
    # What the H200 showed: the in-process engine still held most of the GPU while the services'
    # worker measured (the old arithmetic: 0.9 * total - (total - free) - peak < 0).
    held = 120 * GiB
    r = MemoryReading(total=H200, free=H200 - held - 3 * GiB, weights=3 * GiB, peak=GiB, own=3 * GiB)
    assert r.held_by_others == held
    with pytest.raises(KVBudgetError) as caught:
        kv_budget(r, 0.9, BLOCK)
    text = str(caught.value)
    assert "does not fit in what is free" in text and "held by others 120.00 GiB" in text, text
    # what the error advises fits: (free + weights) / total, rounded down
    advised = float(text.rsplit("at most ", 1)[1])
    assert advised == 0.142
    assert kv_budget(r, advised, BLOCK) <= r.free - r.peak


def test_nothing_free_says_so_without_a_utilization_that_cannot_help():
    r = MemoryReading(total=H200, free=GiB // 2, weights=3 * GiB, peak=GiB, own=3 * GiB)
    with pytest.raises(KVBudgetError, match=r": 0 bytes beside the activation peak .*: stop them$"):
        kv_budget(r, 0.9, BLOCK)


# ---- the CUDA graphs' pool -----------------------------------------------------------------------
def test_the_graph_reserve_is_the_largest_captured_steps_share_of_the_peak():
    peak = 3 * GiB
    assert graph_reserve(peak, 2048, 2048) == peak  # mixed-step graphs up to the token budget: a whole step
    assert graph_reserve(peak, 2048, 256) == peak // 8  # decode graphs alone, 256 rows of a 2048-token profile
    assert graph_reserve(peak, 2048, 4096) == 2 * peak  # more rows than the profiled step: linear past it
    assert graph_reserve(10, 3, 1) == 4  # rounded up
    assert graph_reserve(peak, 2048, 0) == 0 == graph_reserve(peak, 0, 256)  # no graphs, or no profile
    with pytest.raises(ValueError, match="negative"):
        graph_reserve(peak, 2048, -1)


def test_the_graphs_pool_comes_out_of_the_budget():
    r = reading(free=H200 - 3 * GiB - GiB // 2)
    graphs = graph_reserve(r.peak, 2048, 2048)
    assert kv_budget(r, 0.9, BLOCK, graphs) == kv_budget(r, 0.9, BLOCK) - GiB
    # a budget the graphs leave no block says so, and what would help
    small = MemoryReading(total=8 * GiB, free=7 * GiB, weights=3 * GiB, peak=GiB // 2, own=3 * GiB)
    assert kv_budget(small, 0.5, BLOCK) == GiB // 2
    with pytest.raises(KVBudgetError) as caught:
        kv_budget(small, 0.5, BLOCK, GiB // 2)
    text = str(caught.value)
    for part in ("holds no block", "and its CUDA graphs", "CUDA graphs ~0.50 GiB", "capture fewer graphs"):
        assert part in text, (part, text)
    # and what is free must hold them beside the pool and the peak
    crowded = MemoryReading(total=8 * GiB, free=3 * GiB // 4, weights=3 * GiB, peak=GiB // 4, own=3 * GiB)
    with pytest.raises(KVBudgetError, match=f": {GiB // 4} bytes beside the activation peak and the CUDA graphs"):
        kv_budget(crowded, 0.5, BLOCK, GiB // 4)


def test_size_kv_cache_reserves_the_graphs_a_cuda_runner_will_capture(tiny_llama):
    """The model setup's sizing with a measured reading (given: nothing runs on a GPU here) for a runner on
    CUDA: mixed-step graphs keep a whole step's peak out of the pool, decode graphs their rows' share, a
    runner with LoRA slots (which captures none) nothing."""
    from types import SimpleNamespace

    import torch

    from pagedserve.common.compilation import graph_plan
    from pagedserve.common.model_config import ModelConfig
    from pagedserve.worker.model_setup import KVSettings, size_kv_cache

    cuda = SimpleNamespace(config=ModelConfig.from_folder(tiny_llama), dtype=torch.float16,
                           device=torch.device("cuda"), tensor_parallel_size=1, lora=None, drafter=None)
    r = MemoryReading(total=8 * GiB, free=7 * GiB, weights=GiB, peak=GiB, own=GiB)

    def sized(mode: str, runner=cuda):
        tokens = graph_plan({"cudagraph_mode": mode}).graph_tokens(256, 2048)
        return size_kv_cache(runner, KVSettings(16, None, 0.5, 2048, 0, tokens), r)
    eager, decode, mixed = sized("NONE"), sized("FULL_DECODE_ONLY"), sized("FULL")
    assert (eager.graph_reserve, decode.graph_reserve, mixed.graph_reserve) == (0, GiB // 8, GiB)
    block = eager.block_bytes
    assert eager.num_blocks == (2 * GiB) // block
    assert decode.num_blocks == (2 * GiB - GiB // 8) // block and mixed.num_blocks == GiB // block
    assert sized("FULL", SimpleNamespace(**{**vars(cuda), "lora": object()})).graph_reserve == 0


def test_a_model_whose_images_go_whole_profiles_a_step_one_image_larger(tiny_llama):
    """Gemma 3's steps may run one image past --max-num-batched-tokens (scheduler/core/image_chunks.py): its
    memory profile runs a step of the budget plus an image's placeholders less one, and the graphs' reserve
    is scaled from that size; a text model's profile runs the budget."""
    from dataclasses import replace
    from types import SimpleNamespace

    import torch

    from pagedserve.common.model_config import ModelConfig
    from pagedserve.common.vision_config import gemma3_parts
    from pagedserve.worker.model_setup import KVSettings, size_kv_cache

    _, vision = gemma3_parts({"vision_config": {"image_size": 896, "patch_size": 14}})  # gemma-3-4b-it's tower
    assert vision["num_image_tokens"] == 256
    text = ModelConfig.from_folder(tiny_llama)
    r = MemoryReading(total=8 * GiB, free=7 * GiB, weights=GiB, peak=GiB, own=GiB)
    profiled = []

    def measure(runner, tokens):
        profiled.append(tokens)
        return r

    def sized(config):
        runner = SimpleNamespace(config=config, dtype=torch.float16, device=torch.device("cuda"),
                                 tensor_parallel_size=1, lora=None, drafter=None)
        return size_kv_cache(runner, KVSettings(16, None, 0.5, 2048, 0, 2048), measure=measure)
    assert sized(replace(text, vision=vision)).graph_reserve == -(-GiB * 2048 // (2048 + 255))
    assert sized(text).graph_reserve == GiB
    assert profiled == [2048 + 255, 2048]


def test_utilization_outside_0_1_is_refused():
    r = reading(free=H200 // 2)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="--gpu-memory-utilization must be in"):
            kv_budget(r, bad, BLOCK)


def test_an_explicit_budget_below_one_block_is_refused():
    assert num_blocks(3 * BLOCK + 1, BLOCK) == 3
    with pytest.raises(KVBudgetError, match=f"budget of {BLOCK - 1} bytes holds no block"):
        num_blocks(BLOCK - 1, BLOCK)


def test_the_module_imports_no_torch():
    code = "import sys, pagedserve.worker.device_memory; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---- the tensor-parallel ranks' devices (worker/process_group.py, worker/local_ranks.py) ----------
def test_each_tensor_parallel_rank_takes_its_own_gpu_and_nccl():
    import torch

    from pagedserve.worker.process_group import dist_backend, rank_torch_device
    cuda = torch.device("cuda")
    assert [str(rank_torch_device(cuda, r, device_count=2, env={})) for r in (0, 1)] == ["cuda:0", "cuda:1"]
    # an index the caller had is not every rank's: each takes its local rank's
    assert str(rank_torch_device(torch.device("cuda:0"), 1, device_count=2, env={})) == "cuda:1"
    assert rank_torch_device(torch.device("cpu"), 1, device_count=0, env={}) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES='1'"):
        rank_torch_device(cuda, 1, device_count=1, env={"CUDA_VISIBLE_DEVICES": "1"})
    assert (dist_backend(cuda), dist_backend(torch.device("cpu"))) == ("nccl", "gloo")


def test_a_cuda_rank_needs_an_indexed_device():
    import torch

    from pagedserve.worker.process_group import init_tensor_parallel
    # what the H200 raised inside torch.cuda.set_device; now refused by name before it
    with pytest.raises(ValueError, match=r"rank 1: a CUDA device without an index"):
        init_tensor_parallel(1, 2, "tcp://127.0.0.1:1", torch.device("cuda"))


def test_local_ranks_check_every_rank_s_gpu_before_spawning_any():
    import torch

    from pagedserve.worker.local_ranks import LocalRanks
    count = torch.cuda.device_count()
    # one rank more than this machine has GPUs: refused at once, no follower left waiting
    with pytest.raises(ValueError, match=f"local rank {count} needs a GPU at index {count}, but torch sees {count}"):
        LocalRanks(count + 1, torch.device("cuda"), {})

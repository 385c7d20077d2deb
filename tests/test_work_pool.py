"""The CPU kernels' thread pool (kernels/cpu/work_pool.cpp) through its probe, and the kernels on
it: every item runs exactly once, in chunks handed out in order, whether the pool's threads take part
or not; an exception in a chunk reaches the caller and leaves the pool usable; a region inside a
region, a second caller while one runs and a forked child all run their items; and a kernel split
across the pool gives the same bits as on one thread (each output element is computed by one
thread, whichever it is).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from pagedserve.common.settings import defaults
from pagedserve.common.settings_cli import argv_for
from pagedserve.kernels import cpu_ops
from pagedserve.worker.main import apply_cpu_kernel_threads

ops = cpu_ops.load()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler for the CPU kernels here")


@pytest.fixture(autouse=True)
def pool_on():
    was_on = ops.set_work_pool(True)
    yield
    ops.set_work_pool(was_on)


@pytest.mark.parametrize("env, on", [({"PAGEDSERVE_WORK_POOL": "1"}, True), ({"PAGEDSERVE_WORK_POOL": "0"}, False),
                                     ({}, False)])
def test_the_pool_is_on_at_load_only_when_the_environment_asks(env, on):
    # what the worker's --cpu-kernel-threads sets (worker/main.py); the in-process engine keeps OpenMP
    code = "from pagedserve.kernels import cpu_ops; print(cpu_ops.load().set_work_pool(True))"
    base = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_WORK_POOL"}
    out = subprocess.run([sys.executable, "-c", code], env=base | env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(on)


def test_the_worker_setting_reaches_the_kernels_environment():
    environ: dict[str, str] = {}
    apply_cpu_kernel_threads("pool", environ)
    assert environ == {"PAGEDSERVE_WORK_POOL": "1"}
    apply_cpu_kernel_threads("openmp", environ)
    assert environ == {"PAGEDSERVE_WORK_POOL": "0"}


def test_serve_hands_openmp_to_the_worker_and_pool_is_the_default():
    assert defaults("worker")["cpu_kernel_threads"] == "pool"
    argv = argv_for("worker", defaults("serve") | {"cpu_kernel_threads": "openmp"})
    assert argv[argv.index("--cpu-kernel-threads") + 1] == "openmp"
    assert "--cpu-kernel-threads" not in argv_for("worker", defaults("serve"))


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("n, chunk, threads", [(1, 1, 2), (7, 3, 2), (100, 1, 2), (100, 64, 4), (5, 8, 2), (9, 2, 1)])
def test_every_item_runs_once(n, chunk, threads):
    by_pool, runs = ops.work_pool_probe(n, chunk, threads)
    assert runs.tolist() == [1] * n
    assert set(by_pool.tolist()) <= {0, 1}
    if threads == 1:
        assert by_pool.sum().item() == 0  # one thread: the caller runs everything itself


def test_pool_threads_take_part_and_keep_chunks_whole():
    # 12 chunks of 3 items sleeping 20 ms each: a pool thread wakes long before the caller is done.
    by_pool, runs = ops.work_pool_probe(36, 3, 2, sleep_us=20_000)
    assert runs.tolist() == [1] * 36
    flags = by_pool.view(12, 3)
    assert (flags == flags[:, :1]).all(), "a chunk was split between threads"
    assert 0 < by_pool.sum().item() < 36, "caller and pool thread should both have run chunks"


def test_an_exception_in_a_chunk_reaches_the_caller_and_the_pool_still_works():
    with pytest.raises(RuntimeError, match="chunk 6 failed"):
        ops.work_pool_probe(20, 3, 2, sleep_us=1000, throw_at=7)
    _, runs = ops.work_pool_probe(20, 3, 2, sleep_us=1000)
    assert runs.tolist() == [1] * 20


def test_a_region_inside_a_region_runs_on_the_thread_that_asked():
    _, runs = ops.work_pool_probe(12, 2, 2, sleep_us=2000, nested=True)
    assert runs.tolist() == [1] * 12  # 100 would mean the inner region left its chunk's thread


def test_two_callers_at_once_both_finish():
    results = {}

    def call(name):
        results[name] = ops.work_pool_probe(40, 2, 2, sleep_us=2000)[1].tolist()

    threads = [threading.Thread(target=call, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {"a": [1] * 40, "b": [1] * 40}


def _probe_in_child(queue):
    queue.put(ops.work_pool_probe(30, 3, 2, sleep_us=2000)[1].tolist())


def test_a_forked_child_runs_its_regions():
    ops.work_pool_probe(10, 1, 2, sleep_us=1000)  # the parent's pool threads exist before the fork
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_probe_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=60) == [1] * 30
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()


def _one_then_two(fn):
    torch.set_num_threads(1)
    one = fn()
    torch.set_num_threads(2)
    return one, fn()


def test_lane_linear_split_across_the_pool_gives_one_threads_bits(two_threads):
    if not ops.lane_linear_available(False):
        pytest.skip("no lane kernel on this CPU")
    torch.manual_seed(0)
    weight, x = torch.randn(3000, 576), torch.randn(40, 576)  # ~190 column groups: several chunks a thread
    packed = ops.pack_lane_weight(weight)
    one, two = _one_then_two(lambda: ops.lane_linear(x, packed, 3000))
    assert torch.equal(one, two)
    assert torch.allclose(two, x @ weight.T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 32])  # one row: a decode step of one stream splits too
def test_repacked_linear_split_across_the_pool_gives_one_threads_bits(two_threads, rows):
    if not ops.repacked_kernel_available():
        pytest.skip("no AVX-512 VNNI here")
    from gguf import GGMLQuantizationType
    from test_quant_kernels import random_blocks

    qtype = int(GGMLQuantizationType["Q4_1"])
    blocks = torch.from_numpy(random_blocks("Q4_1", 3072, 576, np.random.default_rng(3)))
    packed = ops.repack_rows(blocks, qtype)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    one, two = _one_then_two(lambda: ops.repacked_linear(x, [packed], [qtype], [3072], False))
    assert torch.equal(one, two)


def test_block_kernel_one_row_split_across_the_pool_gives_one_threads_bits(two_threads):
    from gguf import GGMLQuantizationType
    from test_quant_kernels import random_blocks

    qtype = int(GGMLQuantizationType["Q4_1"])
    blocks = torch.from_numpy(random_blocks("Q4_1", 3072, 576, np.random.default_rng(4)))
    x = torch.randn(1, 576)
    one, two = _one_then_two(lambda: ops.quant_linear(x, [blocks], [qtype], False))
    assert torch.equal(one, two)


def test_decode_attention_split_across_the_pool_gives_one_threads_bits(two_threads):
    torch.manual_seed(1)
    seqs, heads, kv_heads, dim, block = 48, 9, 3, 64, 16
    lens = torch.randint(200, 700, (seqs,))
    blocks_per = (lens + block - 1) // block
    table = torch.randperm(int(blocks_per.sum()) + 7)[: int(blocks_per.sum())]  # scattered blocks
    tables = torch.zeros(seqs, int(blocks_per.max()), dtype=torch.long)
    start = 0
    for s, b in enumerate(blocks_per.tolist()):
        tables[s, :b] = table[start:start + b]
        start += b
    k_cache = torch.randn(int(blocks_per.sum()) + 7, block, kv_heads, dim)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(seqs, heads, dim)
    one, two = _one_then_two(lambda: ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125))
    assert torch.equal(one, two)

"""LoRA adapters (issue 40): pagedserve's greedy tokens equal transformers + PEFT with the adapter
merged (`merge_and_unload`), float32, on random PEFT adapters of the tiny Llama: one adapter;
four adapters and the base model in one batch; adapters loaded, evicted and unloaded at run
time over fewer slots than adapters; under preemption; the prefix cache kept apart per adapter;
two tensor-parallel ranks; a quantized base; adapters that cannot be served refused."""

from __future__ import annotations

import json

import pytest
import torch

from lora_adapters import build_adapter, merged_greedy
from pagedserve.common.lora import LoraError, LoraRequest, read_adapter
from pagedserve.common.sampling_params import SamplingParams
from tiny_models import build_tiny_model, make_engine

MAX_NEW = 10
PROMPTS = [[5, 17, 99, 3, 41], list(range(20, 58)), [7, 8] * 9 + [200]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
ADAPTERS = {  # name -> build_adapter arguments: ranks, targets, rslora and alpha differ
    "a0": dict(seed=1, r=8, alpha=16.0),
    "a1": dict(seed=2, r=4, alpha=8.0, rslora=True, targets=["q_proj", "v_proj"]),
    "a2": dict(seed=3, r=16, alpha=32.0, targets=["o_proj", "gate_proj", "up_proj", "down_proj"]),
    "a3": dict(seed=4, r=8, alpha=8.0, targets=["k_proj", "down_proj", "q_proj"]),
}


@pytest.fixture(scope="module")
def case(tiny_llama, tmp_path_factory):
    """(base folder, {name: adapter folder}, {name or None: reference tokens per prompt})."""
    root = tmp_path_factory.mktemp("lora")
    folders = {name: build_adapter(tiny_llama, root / name, **kw) for name, kw in ADAPTERS.items()}
    expected = {None: merged_greedy(tiny_llama, None, PROMPTS, MAX_NEW)}
    expected.update({name: merged_greedy(tiny_llama, folder, PROMPTS, MAX_NEW) for name, folder in folders.items()})
    for name in folders:  # each adapter changes the output (else the tests could not fail)
        assert expected[name] != expected[None], name
    return tiny_llama, folders, expected


def lora_engine(base, **overrides):
    return make_engine(base, **{"enable_lora": True, "max_loras": 4, "max_lora_rank": 16, **overrides})


def run(engine, jobs, folders):
    """jobs: [(prompt index, adapter name or None)] in one batch -> their tokens."""
    loras = [None if name is None else LoraRequest(name, i + 1, str(folders[name])) for i, (_, name) in
             enumerate(jobs)]
    results = engine.generate([PROMPTS[p] for p, _ in jobs], GREEDY, lora_request=loras)
    return [samples[0].token_ids for samples in results]


def expect(expected, jobs):
    return [expected[name][p] for p, name in jobs]


def test_one_adapter_equals_merged_transformers(case):
    base, folders, expected = case
    engine = lora_engine(base, max_loras=1, max_lora_rank=8)
    jobs = [(p, "a0") for p in range(len(PROMPTS))]
    assert run(engine, jobs, folders) == expect(expected, jobs)


def test_four_adapters_and_the_base_in_one_batch(case):
    base, folders, expected = case
    engine = lora_engine(base)
    slots_per_step = []
    prepare = engine.runner.lora.prepare

    def spy(states, counts):
        prepare(states, counts)
        slots_per_step.append(len({s.params.lora_name for s in states}))
    engine.runner.lora.prepare = spy
    jobs = [(p, name) for p in range(len(PROMPTS)) for name in [None, *ADAPTERS]]
    assert run(engine, jobs, folders) == expect(expected, jobs)
    assert max(slots_per_step) == 5  # four adapters and the base model shared steps
    if engine.runner.model.ops.name == "cpu-kernels" and engine.runner.model.ops.kernels.lora_delta_available(False):
        # every layer's delta ran on the CPU kernel (o_proj and down_proj too: their all-reduce is one rank's)
        assert all(layer.packed is not None for layer in engine.runner.lora.layers.values())
    engine.add_request("s", PROMPTS[0], GREEDY, lora_request=LoraRequest("a1", 2, str(folders["a1"])))
    assert engine.stats()["adapters"] == {"a1": {"running": 0, "waiting": 1}}  # engine stats by adapter


def test_runtime_load_unload_and_fewer_slots_than_adapters(case):
    base, folders, expected = case
    # Two slots, two adapters in host memory, four adapters asked for: the scheduler holds the
    # third adapter's requests until a slot frees, the worker evicts and reloads.
    engine = lora_engine(base, max_loras=2, max_cpu_loras=2, lora_modules=[f"a0={folders['a0']}"])
    assert engine.list_loras() == ["a0"]
    jobs = [(p, name) for name in ADAPTERS for p in range(2)] + [(2, None)]
    assert run(engine, jobs, folders) == expect(expected, jobs)
    assert len(engine.runner.lora.host) == 2
    assert engine.remove_lora("a0") and "a0" not in engine.list_loras()
    with pytest.raises(LoraError, match="not loaded") as err:
        engine.add_request("x", PROMPTS[0], GREEDY, lora_request=LoraRequest("a0"))
    assert err.value.status == 404
    engine.add_lora(LoraRequest("a0", 1, str(folders["a0"])))  # loaded again at run time
    jobs = [(0, "a0"), (1, None), (2, "a1")]
    assert run(engine, jobs, folders) == expect(expected, jobs)


def test_adapters_under_preemption(case):
    base, folders, expected = case
    # 2 layers * 2 (K, V) * 16 tokens * 2 kv heads * 16 dims * 4 bytes = 8 KiB a block: 10 blocks.
    engine = lora_engine(base, kv_cache_memory=10 * 8192, max_num_batched_tokens=16)
    jobs = [(p, name) for p in range(len(PROMPTS)) for name in ("a0", "a2", None)]
    assert run(engine, jobs, folders) == expect(expected, jobs)
    assert engine.stats()["num_preemptions"] > 0


def test_prefix_cache_hits_never_cross_adapters(case):
    base, folders, expected = case
    engine = lora_engine(base)
    p = 1  # 38 tokens: two full blocks
    for name, hits in [("a0", 0), (None, 0), ("a1", 0), ("a0", 32), (None, 32)]:
        assert run(engine, [(p, name)], folders) == [expected[name][p]], name
        stats = engine.stats()
        new_hits = stats["prefix_cache_hits"] - getattr(engine, "_seen_hits", 0)
        engine._seen_hits = stats["prefix_cache_hits"]
        assert new_hits == hits, name


def test_two_tensor_parallel_ranks(case):
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("tensor parallelism on CUDA needs two GPUs")
    base, folders, expected = case
    with lora_engine(base, tensor_parallel_size=2) as engine:
        jobs = [(0, "a0"), (1, "a1"), (2, "a2"), (0, "a3"), (1, None)]
        assert run(engine, jobs, folders) == expect(expected, jobs)


def test_quantized_base_gets_the_same_delta(case):
    """int8 base weights: ops.linear's output is the quantized matmul plus the adapter's delta."""
    base, folders, _ = case
    engine = lora_engine(base, quantization="int8", max_loras=2)
    runner = engine.runner
    runner.lora.add("a0", str(folders["a0"]))
    layer = runner.model.layers[0].self_attn.qkv_proj
    assert layer.quant is not None

    class State:  # a row of a0, a base row
        def __init__(self, name):
            self.params = SamplingParams(lora_name=name, lora_path=str(folders["a0"]) if name else "")
    runner.lora.prepare([State("a0"), State("")], [1, 1])
    x = torch.randn(2, 64)
    got = runner.model.ops.linear(x, layer)
    weights = runner.lora.host[("a0", str(folders["a0"]))]["layers.0.self_attn.qkv_proj"]
    delta = torch.cat([x[:1] @ a.t() @ b.t() for _, (a, b) in sorted(weights.items())], dim=1)
    base_out = layer(x)
    torch.testing.assert_close(got[0], base_out[0] + delta[0])
    torch.testing.assert_close(got[1], base_out[1])


def test_an_adapter_that_does_not_fit_fails_alone(case, tmp_path):
    """Files and ranks fine, shapes of another model: its requests fail, the others run."""
    base, folders, expected = case
    other = build_tiny_model(tmp_path / "other", "llama", hidden_size=32, intermediate_size=64)
    alien = build_adapter(other, tmp_path / "alien", seed=5, r=4)
    engine = lora_engine(base)
    engine.add_lora(LoraRequest("alien", 9, str(alien)))
    with pytest.raises(RuntimeError, match="'alien' did not load"):
        run(engine, [(0, "alien"), (1, "a0"), (2, None)], {**folders, "alien": alien})
    while engine.has_unfinished():
        engine.step()
    jobs = [(1, "a0"), (2, None)]
    assert run(engine, jobs, folders) == expect(expected, jobs)


def test_adapters_that_cannot_be_served(case, tmp_path):
    base, folders, _ = case
    with pytest.raises(LoraError, match="no folder") as err:
        read_adapter("x", tmp_path / "missing", 16)
    assert err.value.status == 404
    with pytest.raises(LoraError, match="over --max-lora-rank 8"):
        read_adapter("a2", folders["a2"], 8)
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((folders["a0"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes((folders["a0"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(LoraError, match="DoRA") as err:
        read_adapter("dora", dora, 16)
    assert err.value.status == 400
    head = build_adapter(base, tmp_path / "head", seed=9, targets=["q_proj", "lm_head"])
    with pytest.raises(LoraError, match="'lm_head' is not served|lm_head"):
        read_adapter("head", head, 16)
    engine = lora_engine(base, max_lora_rank=8)
    with pytest.raises(LoraError):
        engine.add_lora(LoraRequest("a2", 1, str(folders["a2"])))
    assert engine.list_loras() == []


def test_the_cpu_kernel_adds_each_rows_own_adapter():
    """kernels/cpu/lora_delta.cpp (CpuKernelOps' delta) equals the torch grouped matmul, float32
    and bfloat16, with base rows, an empty slot, an odd rank and a slot rewritten after packing."""
    from pagedserve.kernels import cpu_ops
    from pagedserve.worker.lora.layers import LoraBatch, LoraLayer

    kernels = cpu_ops.load()
    if kernels is None or not kernels.lora_delta_available(False):
        pytest.skip("the CPU kernels are not built here (AVX-512 needed)")
    gen = torch.Generator().manual_seed(0)
    parts, rows = [(0, 48), (48, 20), (68, 20)], [-1, 0, 2, 2, 0, -1, 2, 0, 2]
    for dtype in [torch.float32] + ([torch.bfloat16] if kernels.lora_delta_available(True) else []):
        batch = LoraBatch()
        layer = LoraLayer(object(), parts, 64, max_loras=3, max_rank=5, batch=batch, dtype=dtype,
                          device=torch.device("cpu"))
        adapter = lambda: {p: (torch.randn(5, 64, generator=gen), torch.randn(size, 5, generator=gen))  # noqa: E731
                           for p, (_, size) in enumerate(parts)}
        layer.set_slot(0, adapter())
        layer.set_slot(2, adapter())
        slots = torch.tensor(rows, dtype=torch.int32)
        batch.row_slots, batch.slots = slots, 3
        batch.mask = torch.nn.functional.one_hot(slots.long().clamp(min=0), 3).to(dtype) * (slots >= 0)[:, None]
        x = torch.randn(len(rows), 64, generator=gen).to(dtype)
        out = torch.randn(len(rows), 88, generator=gen).to(dtype)
        for _ in range(2):  # the second time after slot 2 changed: the packed copy follows set_slot
            if dtype == torch.float32:
                want = layer.grouped_delta(x, out.clone()).double()
            else:  # bfloat16: float64 arithmetic on the same values, the shrink rounded as torch's is
                want = out.double().clone()
                for t, s in enumerate(rows):
                    for p, (offset, size) in enumerate(parts):
                        if s >= 0:
                            v = (x[t].double() @ layer.a[s, p].double().t()).to(dtype).double()
                            want[t, offset:offset + size] += v @ layer.b_t[p][s * 5:(s + 1) * 5].double()
            got = layer.packed_delta(x, out.clone(), kernels)
            assert layer.packed is not None
            tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
            torch.testing.assert_close(got.double(), want, **tol)
            assert torch.equal(got[[0, 5]], out[[0, 5]])  # base rows untouched
            layer.set_slot(2, adapter())

"""`pagedserve bench throughput` end to end on a tiny random llama (no tokenizer in the folder).
`pagedserve bench services` (it starts the services): tests/stack/test_bench_stack.py."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from pagedserve.bench import add_bench_parser
from pagedserve.bench.throughput import make_workload
from tiny_models import build_tiny_model

KEYS = {"output_tokens_per_s", "total_tokens_per_s", "baseline_output_tokens_per_s", "baseline_by_batch_size",
        "ratio_vs_transformers", "kv_waste_pct", "num_requests", "num_prompt_tokens", "num_output_tokens",
        "elapsed_s", "dtype", "model", "num_steps", "num_preemptions", "torch_threads", "cpu"}


def test_workload_is_deterministic():
    a, b = make_workload(6, 256), make_workload(6, 256)
    assert a == b
    assert all(16 <= len(p) <= 256 and all(100 <= t < 256 for t in p) for p in a.prompts)
    assert all(16 <= o <= 128 for o in a.output_lens)


def test_request_settings_from_the_sampling_flags():
    from pagedserve.bench.throughput import request_params

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    work = make_workload(3, 256)
    greedy = request_params(parser.parse_args(["bench", "throughput"]), work)
    assert [p.max_tokens for p in greedy] == work.output_lens and not any(p.needs_penalties for p in greedy)
    penalised = request_params(parser.parse_args(["bench", "throughput", "--repetition-penalty", "1.1",
                                                  "--frequency-penalty", "0.5"]), work)
    assert all(p.greedy and p.repetition_penalty == pytest.approx(1.1) and p.frequency_penalty == 0.5
               and p.presence_penalty == 0.0 for p in penalised)
    sampled = request_params(parser.parse_args(["bench", "throughput", "--temperature", "0.8", "--top-p", "0.9",
                                                "--presence-penalty", "0.3"]), work)
    assert all(p.temperature == 0.8 and p.top_p == 0.9 and p.presence_penalty == 0.3 for p in sampled)


def test_bench_throughput_tiny_model(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    out = tmp_path / "bench.json"
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "throughput", "--model", str(model), "--dtype", "float32",
                              "--device", "cpu", "--json", str(out), "--num-prompts", "6",
                              "--baseline-batch-sizes", "4", "--kv-cache-memory", "8MiB"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is as fast and immune to a busy machine
    try:
        returned = args.func(args)
    finally:
        torch.set_num_threads(threads)

    data = json.loads(out.read_text())
    assert KEYS <= data.keys()
    assert data == json.loads(json.dumps(returned))
    work = make_workload(6, 256)
    assert data["num_requests"] == 6
    assert data["num_prompt_tokens"] == work.num_prompt_tokens
    assert data["num_output_tokens"] == work.num_output_tokens
    assert data["output_tokens_per_s"] > 0 and data["total_tokens_per_s"] > data["output_tokens_per_s"]
    assert set(data["baseline_by_batch_size"]) == {"4"}
    assert data["baseline_output_tokens_per_s"] > 0 and data["ratio_vs_transformers"] > 0
    assert 0 <= data["kv_waste_pct"] < 100
    assert data["num_steps"] > 0 and data["dtype"] == "float32"


@pytest.mark.slow  # the default model's tokenizer (a grammar needs one)
def test_bench_structured_tiny_model(tmp_path, default_model_path):
    from service_stack import tiny_model_with_tokenizer

    model = tiny_model_with_tokenizer(tmp_path / "model", default_model_path)
    out = tmp_path / "structured.json"
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "structured", "--model", str(model), "--dtype", "float32", "--device", "cpu",
                              "--json", str(out), "--num-prompts", "2", "--rounds", "1", "--kv-cache-memory", "8MiB"])
    result = args.func(args)
    assert json.loads(out.read_text())["ratio"] == result["ratio"] > 0
    assert result["num_constrained"] == 1 and result["runs"]["plain"][0]["mask_steps"] == 0
    assert result["runs"]["schema"][0]["mask_steps"] > 0 and result["mask_ms_per_step"] > 0
    args = parser.parse_args(["bench", "structured", "--model", str(model), "--dtype", "float32", "--device", "cpu",
                              "--json", str(out), "--new-schema-properties", "40", "--streams", "2", "--rounds", "2",
                              "--kv-cache-memory", "8MiB"])
    result = args.func(args)
    assert json.loads(out.read_text())["ttft_ms"] == result["ttft_ms"] > 0
    assert len(result["rounds"]) == 2 and result["grammar_stalls"] == 0  # compiled ahead, while the request waited
    assert all(r["step_ms_max_after"] >= r["step_ms_median_before"] > 0 for r in result["rounds"])


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_bench_throughput_profile(tmp_path, capsys, quantization):
    """--profile: every step is counted under one kind, its parts add up to no more than the
    step, the floors are positive (quantized layers too: their float weight is an empty
    placeholder), and the hooks are gone afterwards (the engine runs unwrapped)."""
    from pagedserve.worker import step_profile

    model = build_tiny_model(tmp_path / "model")
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "throughput", "--model", str(model), "--dtype", "float32", "--device", "cpu",
                              "--num-prompts", "4", "--no-baseline", "--kv-cache-memory", "8MiB", "--profile",
                              "--quantization", quantization])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = args.func(args)
    finally:
        torch.set_num_threads(threads)
    kinds = data["profile"]["kinds"]
    assert sum(k["steps"] for k in kinds) == data["num_steps"]
    names = {k["kind"] for k in kinds}
    assert names <= set(step_profile.KINDS) and "prefill" in names
    for kind in kinds:
        parts = kind["parts_s"]
        assert set(parts) == set(step_profile.PARTS)
        assert parts["matmul"] > 0 and parts["attention"] > 0 and kind["flops"] > 0
        assert all(v >= 0 for v in parts.values()), parts  # nested timers consistent: nothing counted twice
        assert abs(sum(parts.values()) - kind["total_s"]) <= 1e-6 * max(1.0, kind["total_s"])
        assert kind["matmul_floor_s"] > 0 and kind["weight_bytes_floor_s"] > 0
    out = capsys.readouterr().out
    assert "step kind" in out and "matmul" in out and "lm_head" in out
    from pagedserve.worker.platform import platform_for
    assert "linear" not in vars(platform_for("cpu").ops)  # the profiler's wrapper was taken out again
    assert step_profile.step_kind({"a": 1, "b": 1}) == "decode 2-8"
    assert step_profile.step_kind({"a": 1, "b": 7}) == "mixed" and step_profile.step_kind({"a": 9}) == "prefill"


# ---- bench services: one side at a time on a GPU ---------------------------------------------------
class StackStandIn:
    """Stands in for the services' Stack (tests/stack/test_bench_stack.py starts the real one):
    this test is about the order the bench makes and releases its two sides."""

    def __init__(self, events: list, engines_alive=lambda: 0) -> None:
        self.events = events
        events.append(f"stack started beside {engines_alive()} engine(s)")

    def stop(self) -> None:
        self.events.append("stack stopped")


@pytest.mark.parametrize("exclusive", [True, False])
def test_bench_services_keeps_one_side_resident_on_a_gpu(tiny_llama, exclusive):
    import weakref

    from pagedserve.bench.sides import Sides, pair_order
    from tiny_models import make_engine
    events, built = [], []

    def build():
        engine = make_engine(tiny_llama)
        built.append(weakref.ref(engine))
        events.append("engine built")
        return engine

    sides = Sides(build, lambda: StackStandIn(events, lambda: sum(ref() is not None for ref in built)),
                  exclusive=exclusive)
    for repeat in range(3):
        for side in pair_order(repeat, exclusive):
            if side == "in_process":
                sides.engine()
            else:
                sides.stack()
    sides.close()
    if exclusive:  # ABBA: each switch serves two runs; the engine is gone before the services start
        assert events == ["engine built", "stack started beside 0 engine(s)", "stack stopped", "engine built",
                          "stack started beside 0 engine(s)", "stack stopped"]
    else:
        assert events == ["engine built", "stack started beside 1 engine(s)", "stack stopped"]
    assert built[-1]() is None  # closed: nothing but Sides held it


def test_released_engine_frees_its_tensors(tiny_llama):
    import weakref

    from pagedserve.bench.sides import Sides, free_device_memory
    from tiny_models import make_engine
    sides = Sides(lambda: make_engine(tiny_llama), lambda: StackStandIn([]), exclusive=True)
    weight = weakref.ref(next(sides.engine().runner.model.parameters()))
    assert weight() is not None
    sides.stack()  # releases the engine first, collecting it
    assert weight() is None
    assert free_device_memory() == (torch.cuda.memory_reserved() if torch.cuda.is_available() else None)

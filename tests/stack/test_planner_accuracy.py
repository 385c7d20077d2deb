"""`pagedserve plan-accuracy` end to end on a tiny model that carries the default model's tokenizer:
calibrate, start the services, plan and run one workload, compare. The wiring only: the numbers of
a tiny model on a shared machine say nothing (the default model's are in docs/planner.md)."""

from __future__ import annotations

import json

import pytest

from pagedserve.cli import main


@pytest.mark.slow
def test_plan_accuracy_compares_a_plan_with_a_real_run(tiny_model, tmp_path):
    profile = tmp_path / "profile.json"
    engine = ["--model", str(tiny_model), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "16MiB"]
    assert main(["calibrate", *engine, "--quick", "--repeats", "1", "--out", str(profile)]) == 0
    out = tmp_path / "accuracy"
    assert main(["plan-accuracy", "--profile", str(profile), *engine, "--workloads", "0", "--num-prompts", "6",
                 "--out-dir", str(out)]) == 0
    summary = json.loads((out / "accuracy.json").read_text())
    assert summary["step_overhead_ms"] > 0 and summary["request_overhead_ms"] > 0
    (row,) = summary["rows"]
    assert row["real"]["completed"] == row["plan"]["completed"] == 6
    assert row["plan"]["total_output_tokens"] == row["real"]["total_output_tokens"] == 6 * 64
    for metric in ("median TTFT (ms)", "median TPOT (ms)", "output throughput (tok/s)"):
        assert row["comparison"][metric]["error"] is not None
    assert "Plan vs real run" in (out / "plan_vs_real.html").read_text()

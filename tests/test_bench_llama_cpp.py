"""`pagedserve bench llama-cpp`'s own parts (llama.cpp takes ~15 minutes to build, so CI does not):
llama-bench's JSON read into prefill / decode rates, the GGUF found in a prepared folder, and a
missing llama-bench answered with how to build it (exit 2), through the real command line."""

from __future__ import annotations

import json
import subprocess
import sys

from pagedserve.bench.llama_cpp import find_gguf, parse_llama_bench

# the fields llama-bench -o json writes per test that the command reads (others elided)
LLAMA_BENCH_JSON = json.dumps([
    {"model_type": "llama ?B Q4_1", "n_threads": 2, "n_prompt": 128, "n_gen": 0, "avg_ts": 493.25},
    {"model_type": "llama ?B Q4_1", "n_threads": 2, "n_prompt": 0, "n_gen": 128, "avg_ts": 179.5},
])


def test_llama_bench_json_gives_both_rates():
    assert parse_llama_bench(LLAMA_BENCH_JSON) == {"prefill_tokens_per_s": 493.25, "decode_tokens_per_s": 179.5}


def test_the_gguf_of_a_prepared_folder_or_a_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert find_gguf(str(tmp_path)) == ((tmp_path / "model.gguf").resolve(), tmp_path)
    assert find_gguf(str(tmp_path / "model.gguf")) == (tmp_path / "model.gguf", tmp_path / "model.gguf")


def test_the_gguf_of_a_model_named_as_pagedserve_names_it(tmp_path, monkeypatch):
    """`--model gemma3-270m` (a prepared model's name) was read as a folder of that name in the cwd."""
    named = tmp_path / "models" / "tiny-q4"
    named.mkdir(parents=True)
    (named / "config.json").write_text("{}")
    (named / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("PAGEDSERVE_DATA_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert find_gguf("tiny-q4") == ((named / "model.gguf").resolve(), named)


def test_missing_llama_bench_says_how_to_build_it(tmp_path):
    env = {"PAGEDSERVE_DATA_DIR": str(tmp_path), "PATH": "/nonexistent", "PYTHONPATH": ":".join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", "llama-cpp", "--model", str(tmp_path),
                           "--llama-bench", str(tmp_path / "absent")], env=env, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "llama-bench not found" in done.stderr and "--target llama-bench" in done.stderr
    assert str(tmp_path / "llama.cpp") in done.stderr

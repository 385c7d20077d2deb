"""`pagedserve generate`'s file interface, run as a real process on the default model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "pagedserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_file_interface(tmp_path, default_model_path):
    lines = [
        {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
         "temperature": 0},
        {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "logprobs": 2},
        {"prompt_token_ids": [504, 2365, 6354, 16438], "max_tokens": 5, "temperature": 0.9, "seed": 3, "n": 2,
         "ignore_eos": True},
        {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "min_tokens": 3,
         "top_k": 5, "top_p": 0.9, "min_p": 0.01, "stop_token_ids": [7]},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    proc = run_cli("generate", "--prompts-file", str(src), "--output", str(dst), "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert "KV cache:" in proc.stderr and "maximum concurrency" in proc.stderr
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["index"] for o in out] == [0, 1, 2, 3]
    assert "Paris" in out[0]["outputs"][0]["text"]
    assert out[0]["outputs"][0]["finish_reason"] == "stop"
    assert out[1]["prompt_token_ids"] == [504, 2365, 6354, 16438]  # "The quick brown fox", no template
    assert out[1]["outputs"][0]["text"] == out[1]["outputs"][0]["text"].lstrip("\n")
    logprobs = out[1]["outputs"][0]["logprobs"]
    assert len(logprobs) == len(out[1]["outputs"][0]["token_ids"])
    assert all(len(lp["top_logprobs"]) == 2 and lp["logprob"] <= 0 for lp in logprobs)
    assert len(out[2]["outputs"]) == 2 and all(len(o["token_ids"]) == 5 for o in out[2]["outputs"])
    assert "logprobs" not in out[2]["outputs"][0]
    assert len(out[3]["outputs"][0]["token_ids"]) == 3


def test_generate_one_prompt_and_bad_input(tmp_path, default_model_path):
    proc = run_cli("generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "max_tokens": 4}\n{"prompt": "y", "top_p": 7}\n')
    proc = run_cli("generate", "--prompts-file", str(bad), "--output", str(tmp_path / "o.jsonl"))
    assert proc.returncode == 2
    assert "bad.jsonl:2" in proc.stderr and "top_p must be in (0, 1]" in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()

"""--quantization takes vLLM's names of a checkpoint's method (gptq, gptq_marlin, awq, fp8, bitsandbytes, ...):
a command line written for `vllm serve` works unchanged when the checkpoint is that (it loads as auto
does), and is refused naming both when it is not, or when the checkpoint is unquantized (vLLM would
quantize it on the fly; pagedserve does not), in the engine and in `serve` before any service starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedserve.common.checkpoint_quantization import CHECKPOINT_METHODS, quantization_flag
from test_gptq_checkpoints import gptq_checkpoint
from tiny_models import build_tiny_model, make_engine

GPTQ = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
FBGEMM = {"quantization_config": {"quant_method": "fbgemm_fp8"}}


@pytest.mark.parametrize("flag, config", [("gptq", GPTQ), ("gptq_marlin", GPTQ), ("fp8", FBGEMM),
                                          ("fbgemm_fp8", FBGEMM)])
def test_the_checkpoints_own_method_is_auto(flag, config):
    assert quantization_flag(flag, config) == "auto"


@pytest.mark.parametrize("flag", ["auto", "none", "int8"])
def test_our_own_values_pass_as_they_are(flag):
    assert quantization_flag(flag, GPTQ) == flag and quantization_flag(flag, {}) == flag


def test_another_method_or_none_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"--quantization awq: the model is quantized with GPTQ \(quantization_config"):
        quantization_flag("awq", GPTQ)
    with pytest.raises(ValueError, match="--quantization fp8: the model has no quantization_config .* does not "
                                         "quantize one to this method"):
        quantization_flag("fp8", {})
    assert set(CHECKPOINT_METHODS) >= {"gptq", "awq", "fp8", "bitsandbytes", "compressed-tensors", "auto-round"}


def test_the_engine_loads_a_gptq_checkpoint_under_vllms_flag(tmp_path):
    folder, _ = gptq_checkpoint(tmp_path)
    with make_engine(folder, quantization="gptq_marlin") as engine:
        assert engine.runner.quantization == "gguf" and "Q4_1" in engine.runner.weights_description
    with pytest.raises(ValueError, match="--quantization bitsandbytes: .* is quantized with GPTQ"):
        make_engine(folder, quantization="bitsandbytes")


@pytest.mark.parametrize("kind, flag, says", [
    ("gptq", "awq", "--quantization awq: the model in {folder} is quantized with GPTQ"),
    ("plain", "fp8", "--quantization fp8: the model in {folder} has no quantization_config")])
def test_serve_exits_2_before_any_service(tmp_path, kind, flag, says):
    folder = gptq_checkpoint(tmp_path)[0] if kind == "gptq" else build_tiny_model(tmp_path / "plain")
    env = {**os.environ, "PAGEDSERVE_DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(folder), "--port", "0",
                           "--quantization", flag], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says.format(folder=folder) in proc.stderr and "started" not in proc.stderr

"""Where the Triton tests run their kernels: natively with CUDA, else on the CPU under the Triton interpreter.

`triton_device()` must be called at a test file's top, before anything imports triton.language (and so
pagedserve.kernels.triton): @triton.jit reads TRITON_INTERPRET when each function is defined, triton's own
tl.zeros & co. included. Where triton is missing the file is skipped; where triton.language was imported
before the variable was set (another file of the same process did), the file is skipped, saying so."""

from __future__ import annotations

import os

import pytest
import torch


def triton_device() -> str:
    """"cuda" or "cpu" (the interpreter, set up here)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    tl = pytest.importorskip("triton.language")
    if device == "cpu" and type(tl.standard.zeros).__name__ != "InterpretedFunction":
        pytest.skip("triton.language was imported before TRITON_INTERPRET=1 was set; run this file in its own "
                    "process", allow_module_level=True)
    return device

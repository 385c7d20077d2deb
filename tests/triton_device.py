"""Where the Triton tests run their kernels: natively with CUDA, else on the CPU under the Triton interpreter.

`triton_device()` must be called at a test file's top, before anything imports triton.language (and so
pagedserve.kernels.triton): @triton.jit reads TRITON_INTERPRET when each function is defined, triton's own
tl.zeros & co. included. Where triton is missing the file is skipped; where triton.language was imported
before the variable was set (another file of the same process did), the file is skipped, saying so.
`triton_engine` builds an engine whose attention is the Triton backend, as the mixed-graph tests run it;
`record_steps` notes what each of its steps prepared."""

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


def triton_engine(folder, device: str, budget: int, graphs: bool = True, **overrides):
    """A float32 engine (4 sequences, chunked prefill, `budget` tokens a step) whose attention is the Triton backend
    (interpreted on the CPU), mixed-step graphs with the stand-in when `graphs`."""
    from pagedserve.worker.attention import TritonAttentionBackend
    from pagedserve.worker.graph_runner import StandInGraph
    from tiny_models import make_engine

    overrides.setdefault("enforce_eager", True)  # on a GPU: no CUDA graphs of the engine's own
    engine = make_engine(folder, device=device, max_num_seqs=4, max_num_batched_tokens=budget,
                         enable_chunked_prefill=True, **overrides)
    backend = TritonAttentionBackend()
    for module in engine.runner.model.modules():
        if hasattr(module, "backend"):
            module.backend = backend
    if graphs:
        engine.runner.enable_decode_graphs(4, StandInGraph, budget)
    return engine


def record_steps(runner, describe) -> list:
    """From now on, each step the runner prepares appends describe(the prepared inputs) to the list returned."""
    prepare, steps = runner._prepare, []

    def recording(step):
        out = prepare(step)
        steps.append(describe(out))
        return out

    runner._prepare = recording
    return steps

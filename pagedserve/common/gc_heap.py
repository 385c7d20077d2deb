"""Long-lived objects kept out of Python's cyclic garbage collector while a process serves (vLLM and
SGLang freeze their startup heap the same way).

A serving loop allocates per step, and every so often the collector's oldest generation scans every
tracked object: the model's modules, the libraries', every request's state. In the engine at 256
running requests a full collection came every few steps and cost ~1.4 ms a step on average (the step's
host work was ~8 ms), rescanning objects that were never garbage. Frozen objects (gc.freeze: the
permanent generation) are never scanned; objects allocated later are collected as before.

- `freeze_startup_heap()`: for a service process, once it is set up and before it serves (the worker,
  the scheduler): collect once, freeze what survives, for the process's life.
- `frozen_heap()`: around one serving loop of the in-process engine (LLMEngine.generate, the benches'
  loops): what exists when it starts is frozen until it ends, then goes back to the oldest generation,
  so an engine dropped later is still collected (a process may build many: tests do). No collection on
  entry; nested, or inside a frozen process, it does nothing.

Standard library only.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_startup_heap() -> int:
    """Collect, then freeze every surviving tracked object; returns how many are frozen now."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Every tracked object that exists now is left out of collections until the block ends."""
    if gc.get_freeze_count():  # frozen already: a service process, or an outer loop
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

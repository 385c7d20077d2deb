"""Long-lived objects out of the cyclic collector while serving (pagedserve/common/gc_heap.py): the engine's
loop runs frozen and unfreezes after, so an engine dropped later is still collected; a service freezes
its startup heap for good."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

from pagedserve.common.gc_heap import frozen_heap
from pagedserve.common.sampling_params import SamplingParams
from tiny_models import make_engine


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_frozen_heap_freezes_for_its_block_only():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0  # (the count falls as frozen objects are freed by reference counts)
        with frozen_heap():  # nested: nothing more
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0  # the inner block did not unfreeze
    assert gc.get_freeze_count() == 0


def test_garbage_frozen_by_a_loop_is_collected_after_it():
    cycle = _Cycle()
    alive = weakref.ref(cycle)
    with frozen_heap():
        del cycle
        gc.collect()
        assert alive() is not None  # frozen: no collection reaches it
    gc.collect()
    assert alive() is None


def test_the_engine_loop_runs_frozen_and_a_dropped_engine_is_collected(tiny_llama):
    engine = make_engine(tiny_llama)
    seen = []

    def counted(original=engine.step):  # (a cycle: the engine holds it, it holds the engine)
        seen.append(gc.get_freeze_count())
        return original()

    engine.step = counted
    engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert seen and all(count > 0 for count in seen)
    assert gc.get_freeze_count() == 0
    runner = weakref.ref(engine.runner)
    del engine, counted
    gc.collect()
    assert runner() is None


def test_a_service_freezes_its_startup_heap_for_good():
    code = ("import gc; from pagedserve.common.gc_heap import freeze_startup_heap; "
            "n = freeze_startup_heap(); assert n > 1000 and gc.get_freeze_count() == n; print('ok')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "ok\n"

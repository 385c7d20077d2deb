"""`pagedserve worker`: one worker rank as a gRPC server (flags: pagedserve.common.settings;
heavy imports in main, after the OpenMP wait policy is in the environment: libgomp reads it once,
when torch loads it)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import MutableMapping

from pagedserve.common.settings_cli import add_settings

log = logging.getLogger("pagedserve.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, "worker")


# `brief`: spin this many times (libgomp's pause loop) before sleeping: long enough to bridge the
# gaps between one step's parallel regions, short enough that the threads sleep through the round
# trip between steps, when the scheduler and the front end need the cores. Measured on the 2-core
# Xeon (docs/performance.md): 2,000 and 20,000 both kept one stream within 6% of the in-process
# engine per token; at concurrency 32, 20,000 reached 0.91x of it, passive 0.82x.
BRIEF_SPIN_COUNT = 20000


def apply_omp_wait_policy(policy: str, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Put --omp-wait-policy into the environment (OMP_WAIT_POLICY, or GOMP_SPINCOUNT for brief);
    return what was set (None: nothing, for `runtime` or when the user set OMP_WAIT_POLICY /
    GOMP_SPINCOUNT themselves).

    Why brief is the worker's default: libgomp's own default spins ~300k iterations between
    parallel regions (milliseconds with Intel's pause), and on a machine whose cores the scheduler,
    tokenizer and gateway share, a thread spinning through the round trip between steps delays
    them; passive sleeps at once, and then every parallel region of a step pays a wake-up (~20%
    of a batch-32 decode step). brief spins across the gaps inside a step and sleeps between
    steps (docs/performance.md)."""
    if policy == "runtime" or "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return None
    if "torch" in sys.modules:  # too late: the runtime has read its environment already
        log.warning("--omp-wait-policy %s not applied: torch is already loaded", policy)
        return None
    if policy == "brief":
        environ["GOMP_SPINCOUNT"] = str(BRIEF_SPIN_COUNT)
        return f"GOMP_SPINCOUNT={BRIEF_SPIN_COUNT}"
    environ["OMP_WAIT_POLICY"] = policy.upper()
    return environ["OMP_WAIT_POLICY"]


def apply_cpu_kernel_threads(choice: str, environ: MutableMapping[str, str] = os.environ) -> None:
    """Put --cpu-kernel-threads into the environment the CPU kernels read when they load
    (PAGEDSERVE_WORK_POOL). Why the pool is the worker's default and not the in-process engine's:
    on two cores shared with the front end, OpenMP's split-up-front regions waited for whichever
    core the front end held (in-process W64 beside a process taking 21% of a core: 1.17x faster on
    the pool); with the cores to itself, the pool's threads and torch's own spinning OpenMP threads
    contend, and in process W64 ran 0.92x on the pool with OpenMP's default spin
    (docs/performance.md)."""
    environ["PAGEDSERVE_WORK_POOL"] = "1" if choice == "pool" else "0"


def main(args: argparse.Namespace) -> int:
    apply_omp_wait_policy(args.omp_wait_policy)
    apply_cpu_kernel_threads(args.cpu_kernel_threads)
    from pagedserve.worker.server import serve
    return serve(args)

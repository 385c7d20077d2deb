"""`pagedserve worker`: one worker rank as a gRPC server (flags: pagedserve.common.settings;
heavy imports in main, after the OpenMP wait policy is in the environment: libgomp reads it once,
when torch loads it)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import MutableMapping

from pagedserve.common.settings import add_settings

log = logging.getLogger("pagedserve.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, "worker")


def apply_omp_wait_policy(policy: str, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Put --omp-wait-policy into the environment as OMP_WAIT_POLICY; return what was set (None:
    nothing, for `runtime` or when the user set OMP_WAIT_POLICY / GOMP_SPINCOUNT themselves).

    Why passive is the worker's default: its OpenMP threads spin between parallel regions
    (libgomp spins ~300k iterations before it sleeps), and on a machine whose cores the scheduler,
    tokenizer and gateway share, a thread spinning on the core a descheduled team member needs
    stalls every region behind it. On the 2-core test machine a one-stream decode took 5-20x longer
    spinning than sleeping while other processes ran (docs/performance.md)."""
    if policy == "runtime" or "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return None
    if "torch" in sys.modules:  # too late: the runtime has read its environment already
        log.warning("--omp-wait-policy %s not applied: torch is already loaded", policy)
        return None
    environ["OMP_WAIT_POLICY"] = policy.upper()
    return environ["OMP_WAIT_POLICY"]


def main(args: argparse.Namespace) -> int:
    apply_omp_wait_policy(args.omp_wait_policy)
    from pagedserve.worker.server import serve
    return serve(args)

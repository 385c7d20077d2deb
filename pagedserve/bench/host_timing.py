"""What the host-time benches (`bench layout`, `bench sampler`) share: their timing flags and their JSON rows.
The timing itself is kernels.host_cost.median_us. No torch here."""

from __future__ import annotations

import argparse
import json


def timing_parser(bench_sub, name: str, help_text: str, doc: str, run, calls: int, rounds: int
                  ) -> argparse.ArgumentParser:
    """The bench's subcommand (its module docstring as description, `run` its function) with the timing
    flags; the caller adds its own."""
    p = bench_sub.add_parser(name, help=help_text, description=doc,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=calls, help=f"calls a timing round (default {calls})")
    p.add_argument("--rounds", type=int, default=rounds, help=f"timing rounds, the median reported (default {rounds})")
    p.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON here")
    p.set_defaults(func=run)
    return p


def write_rows(path: str | None, rows: list[dict]) -> None:
    """The bench's rows as JSON at path (None: nowhere)."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)

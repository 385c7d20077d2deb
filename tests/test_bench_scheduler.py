"""`pagedserve bench scheduler`: the scheduler's host time a step at N decode rows (no model)."""

from __future__ import annotations

import json

import pytest

from pagedserve.cli import build_parser


@pytest.mark.parametrize("extra", [[], ["--no-prefix-caching"]])
def test_bench_scheduler_times_decode_steps(tmp_path, capsys, extra):
    out = tmp_path / "scheduler.json"
    args = build_parser().parse_args(["bench", "scheduler", "--rows", "8", "--steps", "20", "--warmup", "2",
                                      "--prompt-len", "20", "--block-size", "4", "--repeats", "2",
                                      "--json", str(out), *extra])
    assert args.func(args) == 0  # and every timed step ran exactly one token a row (the bench checks)
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 2 and all(r["rows"] == 8 and r["schedule_ms"] > 0 and r["update_ms"] > 0 for r in runs)
    assert capsys.readouterr().out.count("8 decode rows: schedule") == 2


def test_bench_scheduler_refuses_empty_runs():
    args = build_parser().parse_args(["bench", "scheduler", "--rows", "0"])
    with pytest.raises(SystemExit, match="--rows"):
        args.func(args)

"""`pagedserve bench sampler`: one step's sampling by the rows' settings (no model)."""

from __future__ import annotations

import json

import pytest

from pagedserve.cli import build_parser


def test_bench_sampler_times_every_kind_of_row(tmp_path, capsys):
    out = tmp_path / "sampler.json"
    args = build_parser().parse_args(["bench", "sampler", "--rows", "4", "--vocab", "300", "--calls", "1",
                                      "--rounds", "1", "--json", str(out)])
    assert args.func(args) == 0
    rows = json.loads(out.read_text())
    assert [r["rows"] for r in rows] == ["greedy", "temperature 1.0", "temperature 1.0, seeded", "top_k 50",
                                         "top_p 0.95, peaked", "top_p 0.95, flat",
                                         "penalties, 1,000 outputs, rows kept", "penalties, 1,000 outputs, from lists"]
    assert all(r["ms"] > 0 for r in rows)
    assert capsys.readouterr().out.count("a step of 4 rows") == 8


def test_bench_sampler_refuses_an_empty_step():
    args = build_parser().parse_args(["bench", "sampler", "--rows", "0"])
    with pytest.raises(SystemExit, match="--rows"):
        args.func(args)

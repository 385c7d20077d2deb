"""`pagedserve bench layout`: a step's layout on the host, eager against a graph's (no model, no GPU)."""

from __future__ import annotations

import json

import pytest

from pagedserve.cli import build_parser


def test_bench_layout_times_both_layouts_of_both_steps(tmp_path, capsys):
    out = tmp_path / "layout.json"
    args = build_parser().parse_args(["bench", "layout", "--decodes", "12", "--calls", "2", "--rounds", "1",
                                      "--json", str(out)])
    assert args.func(args) == 0
    rows = json.loads(out.read_text())
    assert [r["step"] for r in rows] == ["mixed (12 decodes + 4 chunks)", "decode (256 rows)"]
    keys = ("eager_rows_us", "graph_rows_us", "eager_lists_us", "graph_lists_us")
    assert all(r[key] > 0 for r in rows for key in keys)
    assert capsys.readouterr().out.count("layout eager") == 2


@pytest.mark.parametrize("argv,message", [(["--decodes", "0"], "--decodes"), (["--width", "4"], "--width 4")])
def test_bench_layout_refuses_what_it_cannot_time(argv, message):
    args = build_parser().parse_args(["bench", "layout", *argv])
    with pytest.raises(SystemExit, match=message):
        args.func(args)

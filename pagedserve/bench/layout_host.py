"""`pagedserve bench layout`: the host time of a step's layout (worker/input_batch.py), eager against a graph's.

Every GPU step pays it on the host, graphs or not: the token ids, positions, slot mapping, lengths and block
tables written into the persistent input buffer. This times the eager layout (layout_step) and the one a
graph reads (layout_graph_mixed for a mixed step, layout_graph_decode for a pure decode step) for a
W1024-like mixed step (--decodes decode rows of 20-380 positions beside 4 prefill chunks) and a pure decode
step of --decodes rows, 16-token blocks, tables --width blocks wide; the median microseconds a call over
--rounds rounds of --calls calls. CPU tensors (the host's part: on CUDA one non-blocking copy follows).
Each layout is timed twice: with the block tables gathered from their persistent rows (block_table.py, what
the model runner does) and copied from each request's list (what it did before: states without a row).
"""

from __future__ import annotations

import argparse

from pagedserve.bench.host_timing import timing_parser, write_rows


def add_layout_parser(bench_sub) -> None:
    p = timing_parser(bench_sub, "layout", "the host time of a step's layout, eager against a graph's", __doc__,
                      run_layout_bench, calls=50, rounds=5)
    p.add_argument("--decodes", type=int, default=190, help="decode rows of the mixed step (the decode step: 256)")
    p.add_argument("--width", type=int, default=256, help="blocks a table row holds (max_model_len / 16)")


def layout_calls(decodes: int, chunks: list[tuple[int, int]], width: int, rows: bool, seed: int = 0) -> dict:
    """The step's layout calls, eager and a graph's, over request states made once (rows: with their block
    tables' rows, else laid out from their lists)."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from pagedserve.common.model_config import KVGroups
    from pagedserve.worker.block_table import BlockTables
    from pagedserve.worker.input_batch import InputBatch, layout_graph_decode, layout_graph_mixed, layout_step

    bs, rng = 16, np.random.default_rng(seed)
    tables = BlockTables() if rows else None

    def states(lengths):
        made = [(SimpleNamespace(num_computed_tokens=c, token_ids=list(range(c + n)), spec_token_ids=[],
                                 block_ids=rng.permutation(20000)[:-(-(c + n) // bs)].tolist(), group_block_ids=[],
                                 table_row=-1), n) for c, n in lengths]
        for state, _ in made if tables is not None else ():
            tables.assign(state)
        return made

    dec = states([(int(c), 1) for c in rng.integers(20, 380, decodes)])
    pre = states(chunks)
    tokens = decodes + sum(n for _, n in chunks)
    eager, graph = InputBatch(torch.device("cpu")), InputBatch(torch.device("cpu"))
    if chunks:
        size = -(-tokens // 64) * 64
        graph_fn = lambda: layout_graph_mixed(graph, dec, pre, tokens, size, size, decodes + len(chunks) + 1,  # noqa: E731
                                              width, bs, tables)
    else:
        graph_fn = lambda: layout_graph_decode(graph, dec, decodes, decodes, width, bs, tables)  # noqa: E731
    if graph_fn() is None:
        raise SystemExit(f"--width {width} holds no table of {380 // bs + 1} blocks")
    return {"eager": lambda: layout_step(eager, dec, pre, tokens, KVGroups(((0,),), (0,)), bs, tables=tables),
            "graph": graph_fn}


def run_layout_bench(args: argparse.Namespace) -> int:
    from pagedserve.kernels.host_cost import median_us  # (torch loads when the bench runs)

    if args.decodes < 1 or args.calls < 1 or args.rounds < 1:
        raise SystemExit("--decodes, --calls and --rounds must be at least 1")
    rows = []
    steps = ((f"mixed ({args.decodes} decodes + 4 chunks)", args.decodes, [(0, 160), (100, 150), (0, 200), (40, 116)]),
             ("decode (256 rows)", 256, []))
    for step, decodes, chunks in steps:
        times = {}
        for source in ("rows", "lists"):
            fns = layout_calls(decodes, chunks, args.width, source == "rows")
            times.update({f"{kind}_{source}": median_us(fn, args.calls, args.rounds) for kind, fn in fns.items()})
        rows.append({"step": step, **{f"{key}_us": value for key, value in times.items()}})
        print(f"{step}: layout eager {times['eager_rows']:.0f} us, a graph's {times['graph_rows']:.0f} us "
              f"(tables from their lists: {times['eager_lists']:.0f} / {times['graph_lists']:.0f} us)")
    write_rows(args.json, rows)
    return 0

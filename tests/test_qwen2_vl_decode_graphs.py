"""Qwen2-VL's text steps through decode graphs (worker/graph_runner.py's DecodeGraphRunner with the CPU's
stand-in graph): a decode graph reads positions where the layout put them, M-RoPE's shift already added
(InputBatch.rope_shift), its padding rows repeating row 0's shifted position; steps with image placeholders
run eagerly. The greedy tokens equal transformers' with graphs replayed, and a step with more decode rows than
requests (padding) leaves the next tokens right."""

from __future__ import annotations

import pytest

from pagedserve.worker import image_rows
from pagedserve.worker.graph_runner import StandInGraph
from test_qwen2_vl import two_images
from tiny_qwen2_vl_model import Reference, build_tiny_qwen2_vl, prompt_of, random_image, text
from tiny_models import STEPS, check, make_engine, run_requests


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    folder = build_tiny_qwen2_vl(tmp_path_factory.mktemp(request.param + "-graphs"), request.param)
    return folder, Reference(folder, request.param)


def recording(runner) -> list[tuple[bool, bool]]:
    """(whether the step had image rows, whether it replayed a graph) of each step the runner prepares."""
    prepare, steps = runner._prepare, []

    def prepared(step):
        out = prepare(step)
        steps.append((image_rows.has_image_rows(out[3], out[4]), runner._graph_size is not None))
        return out

    runner._prepare = prepared
    return steps


def test_decode_graphs_take_the_shifted_positions(qwen):
    folder, ref = qwen
    engine = make_engine(folder, max_num_seqs=8)
    engine.runner.enable_decode_graphs(8, StandInGraph)
    steps = recording(engine.runner)
    one = two_images(80)
    other = prompt_of(random_image(81, 56, 140), text(82, 5))  # an image first: a shift of 5 - 10
    plain = [1] + text(83, 7)
    results = run_requests(engine, [("one", one[0], one[2]), ("other", other[0], other[2]), ("text", plain, [])])
    check(results["one"][0][0], ref.greedy(one[0], one[1], STEPS))
    check(results["other"][0][0], ref.greedy(other[0], other[1], STEPS))
    check(results["text"][0][0], ref.greedy(plain, [], STEPS))
    graphs = engine.runner.decode_graphs.graphs
    assert sum(g.replays for g in graphs.values()) > 0 and 4 in graphs  # 3 rows: bucket 4, one padding row
    assert any(has for has, _ in steps) and not any(has and graphed for has, graphed in steps)

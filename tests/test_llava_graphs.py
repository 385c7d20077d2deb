"""LLaVA beside mixed-step graphs (worker/graph_runner.py's MixedGraphRunner, on the CPU the Triton backend
under its interpreter and the stand-in graph, as tests/test_mixed_graphs.py runs them): a step whose
positions cover an image's placeholders runs eagerly with the image's rows, the text-only steps around it
still replay their graphs, and the greedy tokens equal transformers' LlavaForConditionalGeneration."""

from __future__ import annotations

import pytest

from triton_device import record_steps, triton_device, triton_engine

DEVICE = triton_device()  # before anything imports triton.language

from pagedserve.worker import image_rows  # noqa: E402
from test_llava import Reference, prompt_of, random_image, text  # noqa: E402
from tiny_models import build_tiny_llava, check, run_requests  # noqa: E402

BUDGET = 32


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = build_tiny_llava(tmp_path_factory.mktemp("llava-graphs"))
    return folder, Reference(folder)


def test_image_steps_run_eagerly_beside_mixed_graphs(llava):
    folder, ref = llava
    engine = triton_engine(folder, DEVICE, BUDGET)
    runner = engine.runner
    steps = record_steps(runner, lambda out: (image_rows.has_image_rows(out[3], out[4]),
                                              runner._mixed_size is not None or runner._graph_size is not None))
    plain = [1] + text(60, 40)  # chunks of text beside the image prompt's
    ids, pixels, images = prompt_of([1] + text(61, 9), random_image(60), text(62, 12), random_image(61), text(63, 3))
    results = run_requests(engine, [("text", plain, []), ("image", ids, images)])
    check(results["text"][0][0], ref.greedy(plain, []))
    check(results["image"][0][0], ref.greedy(ids, pixels))
    assert any(has for has, _ in steps) and not any(has and graphed for has, graphed in steps)
    assert any(graphed for has, graphed in steps if not has)
    assert runner.mixed_graphs is not None and runner.mixed_graphs.graphs  # mixed text steps were captured

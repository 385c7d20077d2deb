"""Qwen2-VL beside mixed-step graphs (worker/graph_runner.py's MixedGraphRunner, on the CPU the Triton backend
under its interpreter and the stand-in graph, as tests/test_llava_graphs.py runs LLaVA): chunked prefill's
text-only chunks after an image and the decodes replay graphs with M-RoPE's shifted positions (written before
the upload by InputBatch.rope_shift), the steps whose positions cover an image's placeholders run eagerly with
the three sections, and the greedy tokens equal transformers'."""

from __future__ import annotations

import pytest

from triton_device import record_steps, triton_device, triton_engine

DEVICE = triton_device()  # before anything imports triton.language

from pagedserve.worker import image_rows  # noqa: E402
from tiny_models import STEPS, check, run_requests  # noqa: E402
from tiny_qwen2_vl_model import Reference, build_tiny_qwen2_vl, prompt_of, random_image, text  # noqa: E402

BUDGET = 32


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl-mixed-graphs"), "qwen2_vl")
    return folder, Reference(folder, "qwen2_vl")


def test_text_chunks_after_an_image_replay_mixed_graphs(qwen):
    folder, ref = qwen
    engine = triton_engine(folder, DEVICE, BUDGET)
    runner = engine.runner

    def step_kind(out):
        graphed = runner._mixed_size is not None or runner._graph_size is not None
        past_image = any(s.images and s.num_computed_tokens >= s.images[-1].end for s in out[3])  # shifted rows
        return image_rows.has_image_rows(out[3], out[4]), graphed, runner._mixed_size is not None and past_image

    steps = record_steps(runner, step_kind)
    plain = [1] + text(60, 40)
    # an image early, then 60 tokens of text: its later chunks are text, shifted by 3 - 6
    ids, pixels, images = prompt_of([1] + text(61, 5), random_image(60, 56, 84), text(62, 60))
    results = run_requests(engine, [("text", plain, []), ("image", ids, images)])
    check(results["text"][0][0], ref.greedy(plain, [], STEPS))
    check(results["image"][0][0], ref.greedy(ids, pixels, STEPS))
    assert any(has for has, _, _ in steps) and not any(has and graphed for has, graphed, _ in steps)
    assert any(mixed for has, _, mixed in steps if not has)  # a mixed graph ran the image request's shifted text
    assert runner.mixed_graphs is not None and runner.mixed_graphs.graphs

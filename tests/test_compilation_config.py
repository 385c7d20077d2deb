"""--compilation-config (pagedserve/common/compilation.py): vLLM's cudagraph_mode decides which steps replay CUDA
graphs, --enforce-eager turns them all off, a bad value fails naming the field before anything loads."""

from __future__ import annotations

import argparse

import pytest

from pagedserve.common.compilation import GraphPlan, graph_plan, with_flags
from pagedserve.common.settings_cli import add_settings


@pytest.mark.parametrize("config,plan", [
    (None, GraphPlan(True, True)),
    ("", GraphPlan(True, True)),
    ('{"cudagraph_mode": "FULL_AND_PIECEWISE"}', GraphPlan(True, True)),
    ('{"cudagraph_mode": "FULL"}', GraphPlan(True, True)),
    ('{"cudagraph_mode": "full_decode_only"}', GraphPlan(True, False)),
    ({"cudagraph_mode": "NONE"}, GraphPlan(False, False)),
    ("{}", GraphPlan(True, True)),
])
def test_cudagraph_modes(config, plan):
    assert graph_plan(config) == plan
    assert graph_plan(config, enforce_eager=True) == GraphPlan(False, False)


def test_the_largest_step_a_graph_captures():
    """What the KV budget reserves the graphs' pool for (device_memory.graph_reserve)."""
    assert GraphPlan(True, True).graph_tokens(256, 2048) == 2048  # mixed steps up to the token budget
    assert GraphPlan(True, True).graph_tokens(256, 128) == 256  # a decode step of every row is larger
    assert GraphPlan(True, False).graph_tokens(256, 2048) == 256  # decode graphs alone: max_num_seqs rows
    assert GraphPlan(False, False).graph_tokens(256, 2048) == 0


def test_vllms_capture_sizes():
    """cudagraph_capture_sizes: those sizes, ascending, each past the limit taken as the limit (decode steps:
    --max-num-seqs rows; the other steps: the token budget); max_cudagraph_capture_size bounds them, or the
    default sizes."""
    plan = graph_plan('{"cudagraph_capture_sizes": [16, 1, 2, 4, 8, 512, 8]}')
    assert plan.sizes == (1, 2, 4, 8, 16, 512)
    assert plan.decode_sizes(256) == [1, 2, 4, 8, 16, 256] and plan.mixed_sizes(2048) == [1, 2, 4, 8, 16, 512]
    assert plan.graph_tokens(256, 2048) == 512
    bounded = graph_plan('{"max_cudagraph_capture_size": 64}')
    assert bounded.decode_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bounded.mixed_sizes(2048) == [16, 32, 48, 64] and bounded.graph_tokens(256, 2048) == 64
    assert graph_plan('{"max_capture_size": 4}').decode_sizes(8) == [1, 2, 4]  # vLLM's older name
    both = graph_plan('{"cudagraph_capture_sizes": [1, 8, 32], "max_cudagraph_capture_size": 8}')
    assert both.decode_sizes(256) == [1, 8] and both.graph_tokens(256, 2048) == 8
    decode_only = graph_plan('{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2]}')
    assert decode_only.mixed_sizes(2048) == [] and decode_only.graph_tokens(256, 2048) == 2
    assert graph_plan('{"cudagraph_capture_sizes": [4]}', enforce_eager=True).decode_sizes(8) == []


@pytest.mark.parametrize("config,message", [
    ('{"cudagraph_capture_sizes": []}', "cudagraph_capture_sizes must be a non-empty list of positive integers"),
    ('{"cudagraph_capture_sizes": [1, 0]}', "cudagraph_capture_sizes must be"),
    ('{"cudagraph_capture_sizes": [true]}', "cudagraph_capture_sizes must be"),
    ('{"max_cudagraph_capture_size": -1}', "max_cudagraph_capture_size must be a positive integer"),
    ('{"max_cudagraph_capture_size": 8, "max_capture_size": 16}', "differ"),
    ("{not json", "must be a JSON object"),
    ("[1]", "must be a JSON object"),
    ('{"cudagraph_mode": "PIECEWISE"}', "cudagraph_mode must be one of FULL_AND_PIECEWISE, FULL, FULL_DECODE_ONLY"),
    ('{"cudagraph_mode": 2}', "cudagraph_mode must be one of"),
    ('{"level": 3, "cudagraph_mode": "FULL"}', "level not supported"),
])
def test_bad_values_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        graph_plan(config)


@pytest.mark.parametrize("service", ["engine", "serve", "worker"])
def test_the_flag_is_vllms(service):
    parser = argparse.ArgumentParser()
    add_settings(parser, service)
    args = parser.parse_args(["--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'])
    assert graph_plan(args.compilation_config) == GraphPlan(True, False)
    assert parser.parse_args([]).compilation_config is None


@pytest.mark.parametrize("service", ["engine", "serve", "worker"])
def test_vllms_capture_size_flags(service):
    """--cudagraph-capture-sizes (vLLM's older --cuda-graph-sizes) and --max-cudagraph-capture-size go into the
    compilation config; one that says otherwise than the config is refused naming both."""
    from pagedserve.common.settings_cli import argv_for
    parser = argparse.ArgumentParser()
    add_settings(parser, service)
    args = parser.parse_args(["--cudagraph-capture-sizes", "1", "2", "--cudagraph-capture-sizes", "8",
                              "--max-cudagraph-capture-size", "64"])
    config = with_flags(args.compilation_config, args.cudagraph_capture_sizes, args.max_cudagraph_capture_size,
                        args.cuda_graph_sizes)
    assert graph_plan(config) == GraphPlan(True, True, (1, 2, 8), 64)
    # the older flag as vLLM's command lines meant it: one value the largest size, several the sizes
    older = parser.parse_args(["--cuda-graph-sizes", "512"])
    assert with_flags(None, older.cudagraph_capture_sizes, older.max_cudagraph_capture_size,
                      older.cuda_graph_sizes) == {"max_cudagraph_capture_size": 512}
    assert with_flags(None, None, None, [1, 8, 64]) == {"cudagraph_capture_sizes": [1, 8, 64]}
    with pytest.raises(ValueError, match="--cuda-graph-sizes \\[64\\] and --max-cudagraph-capture-size differ"):
        with_flags(None, None, 32, [64])
    assert with_flags('{"cudagraph_mode": "NONE"}', None, None) == '{"cudagraph_mode": "NONE"}'
    assert graph_plan(with_flags('{"cudagraph_mode": "FULL_DECODE_ONLY"}', [4], None)) == GraphPlan(True, False, (4,))
    with pytest.raises(ValueError, match="--max-cudagraph-capture-size 8 and --compilation-config's"):
        with_flags('{"max_cudagraph_capture_size": 16}', None, 8)
    if service == "worker":  # what `serve` hands its worker
        sizes = [part for size in (1, 2, 8) for part in ("--cudagraph-capture-sizes", str(size))]
        assert argv_for("worker", vars(args)) == [*sizes, "--max-cudagraph-capture-size", "64"]


def test_the_engine_takes_the_flags():
    from pagedserve.cli import build_parser
    from pagedserve.engine.llm_engine import engine_config_from_args
    args = build_parser().parse_args(["bench", "throughput", "--cudagraph-capture-sizes", "1", "4",
                                      "--max-cudagraph-capture-size", "4"])
    config = engine_config_from_args(args, progress=False)  # what LLMEngine reads its graph plan from
    assert graph_plan(config.compilation_config, config.enforce_eager) == GraphPlan(True, True, (1, 4), 4)


def test_the_engine_refuses_a_bad_one_before_loading(tiny_llama):
    from pagedserve.engine import EngineConfig, LLMEngine
    with pytest.raises(ValueError, match="cudagraph_mode"):
        LLMEngine(EngineConfig(model=str(tiny_llama), compilation_config='{"cudagraph_mode": "SOMETIMES"}'))

"""`--compilation-config`: which steps replay CUDA graphs, as vLLM takes it (a JSON object; pagedserve reads its
"cudagraph_mode"), decided once, here, with --enforce-eager. No torch: the launcher and the worker parse it.

    {"cudagraph_mode": "FULL_AND_PIECEWISE"}   the default: decode steps and the other steps replay graphs
    {"cudagraph_mode": "FULL"}                 the same (vLLM's full graphs of every step)
    {"cudagraph_mode": "FULL_DECODE_ONLY"}     decode steps replay graphs, the other steps run eagerly
    {"cudagraph_mode": "NONE"}                 every step runs eagerly (as --enforce-eager)

pagedserve captures whole steps, mixed ones too (worker/graph_runner.py): where vLLM's FULL_AND_PIECEWISE
captures a mixed step in pieces around attention, pagedserve captures it whole, so the two full modes are one.
"PIECEWISE" alone (no whole-step graph at all) is not offered. The CPU runs every step eagerly whatever is set.
A bad value raises ValueError naming the field and what it may be."""

from __future__ import annotations

import json
from dataclasses import dataclass

MODES = {"FULL_AND_PIECEWISE": (True, True), "FULL": (True, True), "FULL_DECODE_ONLY": (True, False),
         "NONE": (False, False)}


@dataclass(frozen=True, slots=True)
class GraphPlan:
    decode: bool  # pure-decode steps replay graphs
    mixed: bool  # the other steps too (prefill chunks, with decodes beside them or not)

    def graph_tokens(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """The tokens of the largest step a graph captures (0: none): the token budget with mixed-step
        graphs, a decode step of max_num_seqs rows with decode graphs alone. The KV budget reserves
        that step's activations for the graphs' pool (device_memory.graph_reserve)."""
        if self.mixed:
            return max(max_num_batched_tokens, max_num_seqs)
        return max_num_seqs if self.decode else 0


def graph_plan(compilation_config: str | dict | None, enforce_eager: bool = False) -> GraphPlan:
    """What replays graphs on CUDA: --compilation-config's cudagraph_mode, all off with --enforce-eager."""
    if compilation_config is None or compilation_config == "":
        config = {}
    elif isinstance(compilation_config, dict):
        config = compilation_config
    else:
        try:
            config = json.loads(compilation_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--compilation-config must be a JSON object: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("--compilation-config must be a JSON object, e.g. "
                         "'{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}'")
    unknown = sorted(set(config) - {"cudagraph_mode"})
    if unknown:
        raise ValueError(f"--compilation-config: {', '.join(unknown)} not supported (pagedserve reads cudagraph_mode "
                         f"only)")
    mode = config.get("cudagraph_mode", "FULL_AND_PIECEWISE")
    if not isinstance(mode, str) or mode.upper() not in MODES:
        raise ValueError(f"--compilation-config: cudagraph_mode must be one of {', '.join(MODES)}, got {mode!r}")
    decode, mixed = MODES[mode.upper()]
    if enforce_eager:
        decode = mixed = False
    return GraphPlan(decode, mixed)

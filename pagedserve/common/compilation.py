"""`--compilation-config`: which steps replay CUDA graphs, at which sizes, as vLLM takes it (a JSON object; pagedserve
reads the KEYS below), decided once, here, with --enforce-eager. No torch: the launcher and the worker parse it.

    {"cudagraph_mode": "FULL_AND_PIECEWISE"}   the default: decode steps and the other steps replay graphs
    {"cudagraph_mode": "FULL"}                 the same (vLLM's full graphs of every step)
    {"cudagraph_mode": "FULL_DECODE_ONLY"}     decode steps replay graphs, the other steps run eagerly
    {"cudagraph_mode": "NONE"}                 every step runs eagerly (as --enforce-eager)

pagedserve captures whole steps, mixed ones too (worker/graph_runner.py): where vLLM's FULL_AND_PIECEWISE
captures a mixed step in pieces around attention, pagedserve captures it whole, so the two full modes are one.
"PIECEWISE" alone (no whole-step graph at all) is not offered. The CPU runs every step eagerly whatever is set.

Which sizes are captured (vLLM's keys too): by default a decode step pads to the next of 1, 2, 4, then every 8
up to --max-num-seqs (capture_sizes), a mixed step to the next of mixed_capture_sizes up to the token budget.
    {"cudagraph_capture_sizes": [1, 2, 4, 8, 16]}   only those sizes (decode steps: rows, a size past --max-num-seqs
                                                    taken as it; mixed steps: tokens, past the token budget as it)
    {"max_cudagraph_capture_size": 64}              the default sizes up to 64 (vLLM's older "max_capture_size")
A step larger than every captured size runs eagerly. A bad value raises ValueError naming the field and what
it may be."""

from __future__ import annotations

import json
from dataclasses import dataclass

MODES = {"FULL_AND_PIECEWISE": (True, True), "FULL": (True, True), "FULL_DECODE_ONLY": (True, False),
         "NONE": (False, False)}
KEYS = ("cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size", "max_capture_size")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's batch sizes to capture: 1, 2, 4, then every 8 from 8, up to max_num_seqs (always included)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def mixed_capture_sizes(max_tokens: int) -> list[int]:
    """The token counts a mixed step is padded to: every 16 up to 256, every 64 up to 1024, every 128 beyond,
    up to max_tokens (always included). Coarser as steps grow: a step's padding stays under ~1/8 of it."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    steps = [*range(16, 257, 16), *range(320, 1025, 64), *range(1152, max_tokens, 128)]
    return [s for s in steps if s < max_tokens] + [max_tokens]


@dataclass(frozen=True, slots=True)
class GraphPlan:
    decode: bool  # pure-decode steps replay graphs
    mixed: bool  # the other steps too (prefill chunks, with decodes beside them or not)
    sizes: tuple[int, ...] = ()  # cudagraph_capture_sizes, ascending (empty: the default sizes)
    max_size: int = 0  # max_cudagraph_capture_size (0: no bound)

    def _sizes(self, limit: int, default) -> list[int]:
        """The given sizes up to max_size, each past the limit taken as the limit (a step pads to the next
        captured size, and none is larger than the limit); else the default sizes up to the smaller bound."""
        if self.sizes:
            return sorted({min(s, limit) for s in self.sizes if not self.max_size or s <= self.max_size})
        return default(min(limit, self.max_size) if self.max_size else limit)

    def decode_sizes(self, max_num_seqs: int) -> list[int]:
        """The row counts decode steps are captured at, ascending (empty: none)."""
        return self._sizes(max_num_seqs, capture_sizes) if self.decode else []

    def mixed_sizes(self, max_tokens: int) -> list[int]:
        """The token counts the other steps are captured at, ascending (empty: none; max_tokens 0: no budget)."""
        return self._sizes(max_tokens, mixed_capture_sizes) if self.mixed and max_tokens else []

    def graph_tokens(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """The tokens of the largest step a graph captures (0: none): by default the token budget with
        mixed-step graphs, a decode step of max_num_seqs rows with decode graphs alone. The KV budget
        reserves that step's activations for the graphs' pool (device_memory.graph_reserve)."""
        return max([*self.decode_sizes(max_num_seqs)[-1:], *self.mixed_sizes(max_num_batched_tokens)[-1:]],
                   default=0)


def graph_plan(compilation_config: str | dict | None, enforce_eager: bool = False) -> GraphPlan:
    """What replays graphs on CUDA, at which sizes: --compilation-config's KEYS, all off with --enforce-eager."""
    config = _config(compilation_config)
    unknown = sorted(set(config) - set(KEYS))
    if unknown:
        raise ValueError(f"--compilation-config: {', '.join(unknown)} not supported (pagedserve reads "
                         f"{', '.join(KEYS)})")
    mode = config.get("cudagraph_mode", "FULL_AND_PIECEWISE")
    if not isinstance(mode, str) or mode.upper() not in MODES:
        raise ValueError(f"--compilation-config: cudagraph_mode must be one of {', '.join(MODES)}, got {mode!r}")
    decode, mixed = MODES[mode.upper()]
    if enforce_eager:
        decode = mixed = False
    return GraphPlan(decode, mixed, _capture_sizes(config.get("cudagraph_capture_sizes")), _max_size(config))


def with_flags(compilation_config: str | dict | None, capture_sizes: list[int] | None,
               max_capture_size: int | None, cuda_graph_sizes: list[int] | None = None) -> str | dict | None:
    """--compilation-config with vLLM's --cudagraph-capture-sizes and --max-cudagraph-capture-size written into
    it, and its older --cuda-graph-sizes as its command lines meant it (one value: the largest size; several:
    the sizes); a flag that says otherwise than the config or another flag is a ValueError."""
    if cuda_graph_sizes:
        older = {"cudagraph_capture_sizes": cuda_graph_sizes} if len(cuda_graph_sizes) > 1 else \
            {"max_cudagraph_capture_size": cuda_graph_sizes[0]}
        (key, value), = older.items()
        if {"cudagraph_capture_sizes": capture_sizes, "max_cudagraph_capture_size": max_capture_size}[key] \
                not in (None, value):
            raise ValueError(f"--cuda-graph-sizes {cuda_graph_sizes} and --{key.replace('_', '-')} differ: give one")
        capture_sizes, max_capture_size = older.get("cudagraph_capture_sizes", capture_sizes), \
            older.get("max_cudagraph_capture_size", max_capture_size)
    flags = {k: v for k, v in (("cudagraph_capture_sizes", capture_sizes),
                               ("max_cudagraph_capture_size", max_capture_size)) if v}
    if not flags:
        return compilation_config
    config = _config(compilation_config)
    for key, value in flags.items():
        if config.get(key) not in (None, value):
            raise ValueError(f"--{key.replace('_', '-')} {value} and --compilation-config's {key} "
                             f"{config[key]} differ: give one")
    return {**config, **flags}


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _config(compilation_config: str | dict | None) -> dict:
    if compilation_config is None or compilation_config == "":
        return {}
    if isinstance(compilation_config, dict):
        return compilation_config
    try:
        config = json.loads(compilation_config)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--compilation-config must be a JSON object: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("--compilation-config must be a JSON object, e.g. "
                         "'{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}'")
    return config


def _capture_sizes(sizes) -> tuple[int, ...]:
    if sizes is None:
        return ()
    if not isinstance(sizes, list) or not sizes or not all(_positive(s) for s in sizes):
        raise ValueError(f"--compilation-config: cudagraph_capture_sizes must be a non-empty list of positive "
                         f"integers, got {sizes!r}")
    return tuple(sorted(set(sizes)))


def _max_size(config: dict) -> int:
    found = {k: config[k] for k in ("max_cudagraph_capture_size", "max_capture_size") if config.get(k) is not None}
    for key, value in found.items():
        if not _positive(value):
            raise ValueError(f"--compilation-config: {key} must be a positive integer, got {value!r}")
    if len(set(found.values())) > 1:
        raise ValueError("--compilation-config: max_cudagraph_capture_size and max_capture_size differ")
    return next(iter(found.values()), 0)

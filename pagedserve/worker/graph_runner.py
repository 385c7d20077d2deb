"""Decode steps replayed from captured graphs (CUDA graphs on a GPU; a stand-in that runs the same code on
the CPU, so tests exercise everything but the capture itself).

A pure-decode step of batch b runs as the graph captured for the smallest capture size >= b (1, 2, 4, 8,
then every 8 up to max_num_seqs, as vLLM captures). A graph reads its inputs where the step's one upload
puts them: token ids, positions, slot mapping, sequence lengths (one slice of the largest bucket's rows
each) and block tables (max_blocks wide, zero-padded) at fixed offsets of the input batch's device buffer
(input_batch.graph_region; the host writes a step there with layout_graph_decode), so a replay copies no
input. The attention backends build what else they need (the torch backend's mask) from these inside the
graph. The rows past b repeat row 0 exactly (its token, position, slot, table and length): they compute
the same keys and values as row 0 and write them into row 0's slot, so a padding row never touches
another sequence's block, and their outputs are dropped.

Graphs are captured after the KV cache is allocated, lazily on the first decode step that needs a bucket,
and dropped (re-captured on next use) when the cache or the input batch's buffer is re-allocated (the
buffer grows when a step outgrows it: rarely after warm-up): a graph holds their addresses. Steps with
prefills, sliding-window or hybrid KV groups, tables wider than max_blocks, or more sequences than the largest
bucket run eagerly, and so does every step of a model whose attention backend cannot be captured (its
`graph_support`, attention.GraphSupport: the model runner asks before it builds this runner).

Threads: used only from the worker's torch thread (the model runner's), like the model itself."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from pagedserve.worker.attention import AttentionMetadata
from pagedserve.worker.input_batch import InputBatch, graph_region, layout_graph_decode

log = logging.getLogger(__name__)


class GraphCaptureError(RuntimeError):
    """A bucket's graph could not be captured (the caller runs that step, and the ones after, eagerly)."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's batch sizes to capture: 1, 2, 4, then every 8 from 8, up to max_num_seqs (always included)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def bucket_for(batch: int, sizes: list[int]) -> int | None:
    """The smallest capture size that holds `batch` rows, or None when none does."""
    for size in sizes:
        if size >= batch:
            return size
    return None


class StandInGraph:
    """torch.cuda.CUDAGraph's part that the runner uses, for the CPU: `capture(fn)` runs fn once and keeps
    its output tensor as the graph's static output; `replay()` runs fn again on the same static inputs and
    writes the result into that same output tensor, as a replayed CUDA graph does."""

    def __init__(self) -> None:
        self._fn: Callable[[], torch.Tensor] | None = None
        self.output: torch.Tensor | None = None
        self.replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._fn = fn
        self.output = fn()
        return self.output

    def replay(self) -> None:
        self.output.copy_(self._fn())
        self.replays += 1


class CudaGraph:
    """A torch.cuda.CUDAGraph captured on a side stream after warm-up runs, sharing one memory pool with
    the runner's other graphs (vLLM and SGLang capture the same way)."""

    def __init__(self, pool=None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.output: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy initialisation and Triton compiles happen outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.output = fn()
        return self.output

    def replay(self) -> None:
        self.graph.replay()


class DecodeGraphRunner:
    """One graph per capture size for a model's decode steps, reading the input batch's device buffer.

    forward(input_ids, positions, meta) runs the model over the current KV cache (the model runner's)."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 max_num_seqs: int, max_blocks: int, batch: InputBatch,
                 graph_factory: Callable[[], object]) -> None:
        self.forward = forward
        self.sizes = capture_sizes(max_num_seqs)
        self.rows = self.sizes[-1]
        self.max_blocks = max_blocks
        self.batch = batch
        self.graph_factory = graph_factory
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.inputs: tuple[torch.Tensor, ...] | None = None  # graph_region's views, bound on first use
        self._bound = -1  # batch.allocations when the views were taken

    def invalidate(self) -> None:
        """Drop every graph (the KV cache or the input buffer they captured was re-allocated); they
        re-capture on next use."""
        self.graphs.clear()
        self.outputs.clear()

    def bucket(self, num_decodes: int) -> int | None:
        """The capture size a pure-decode step of num_decodes sequences runs at, or None (eagerly)."""
        return bucket_for(num_decodes, self.sizes) if num_decodes else None

    def layout(self, decodes: list, size: int, block_size: int):
        """A pure-decode step written where the graphs read it (input_batch.layout_graph_decode): (input_ids,
        positions, metadata) of `size` rows, or None when a table is wider than the graphs' tables."""
        return layout_graph_decode(self.batch, decodes, size, self.rows, self.max_blocks, block_size)

    def run(self, size: int) -> torch.Tensor:
        """The hidden states [size, hidden] of the step `layout` wrote (the rows past its batch are
        padding): the bucket's graph captured if it is not yet, else replayed; no input is copied."""
        if self._bound != self.batch.allocations:  # the buffer grew: the graphs read the old one
            self.invalidate()
            self.inputs = graph_region(self.batch, self.rows, self.max_blocks)
            self._bound = self.batch.allocations
        if size not in self.graphs:
            graph = self.graph_factory()
            try:
                self.outputs[size] = graph.capture(lambda: self._forward_bucket(size))
            except Exception as exc:
                raise GraphCaptureError(f"capturing the decode graph of batch size {size} failed: {exc}") from exc
            self.graphs[size] = graph
        else:
            self.graphs[size].replay()
        return self.outputs[size]

    def _forward_bucket(self, size: int) -> torch.Tensor:
        input_ids, positions, slots, seq_lens, tables = (t[:size] for t in self.inputs)
        meta = AttentionMetadata(slots, size, tables, seq_lens, None, [])
        return self.forward(input_ids, positions, meta)

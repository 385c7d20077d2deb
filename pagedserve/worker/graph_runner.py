"""Steps replayed from captured graphs (CUDA graphs on a GPU; a stand-in that runs the same code on the CPU,
so tests exercise everything but the capture itself).

Decode graphs. A pure-decode step of batch b runs as the graph captured for the smallest capture size >= b (1,
2, 4, 8, then every 8 up to max_num_seqs, as vLLM captures). A graph reads its inputs where the step's one upload
puts them: token ids, positions, slot mapping, sequence lengths (one slice of the largest bucket's rows each) and
block tables (max_blocks wide, zero-padded) at fixed offsets of the input batch's device buffer
(input_batch.graph_region; the host writes a step there with layout_graph_decode), so a replay copies no input.
An M-RoPE model's positions arrive there already shifted (InputBatch.rope_shift, worker/mrope.py).
The attention backends build what else they need (the torch backend's mask) from these inside the graph. The
rows past b repeat row 0 exactly (its token, position, slot, table and length): they compute the same keys and
values as row 0 and write them into row 0's slot, so a padding row never touches another sequence's block, and
their outputs are dropped.

Mixed-step graphs (MixedGraphRunner). Every other step (decodes beside prefill chunks, prefills alone) of T tokens
runs as the graph captured for the smallest token size >= T (mixed_capture_sizes: every 16 up to 256, every 64 up
to 1024, every 128 beyond, up to the step token budget), laid out packed (input_batch.layout_graph_mixed: each
sequence's query start, length and table, decodes included, at fixed places; max_num_seqs + 1 sequence rows,
whatever the step's count): the padding tokens form sequences of their own whose K/V writes are skipped (slot
-1), so they touch no block, and the rows after have no query. Only where every attention backend says MIXED
(attention.GraphSupport) and the model reads no layout on the host (phi3's long rope does): the attention kernel's
grid is an upper bound over tokens and sequences, so shapes alone decide the launches. The graphs write their
hidden states into one shared output buffer (no per-graph output memory).

Graphs are captured after the KV cache is allocated: on a GPU all of them at once (capture_all, as vLLM and
SGLang capture at start-up, over an idle step: padding only; the largest size first, so that the smaller graphs
reuse the memory the largest took in the runners' one pool), else lazily on the first step that needs a bucket;
they are dropped (re-captured on next use) when the cache or the input batch's buffer is re-allocated (the buffer
grows when a step outgrows it: rarely after warm-up): a graph holds their addresses. A model with several KV groups
(sliding-window layers beside global ones: Gemma 2 and 3, Command R7B) has graphs whose regions hold each group's
slots and tables (every row whole from block 0: a windowed backend starts at its window itself), each layer given
its group's metadata. Steps with tables wider than max_blocks, more sequences
than the largest bucket or more tokens than the largest token size run eagerly, and so does every step of a model
whose attention backend cannot be captured (its `graph_support`: the model runner asks before it builds these
runners).

Threads: used only from the worker's torch thread (the model runner's), like the model itself."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from pagedserve.common.compilation import capture_sizes, mixed_capture_sizes
from pagedserve.worker.attention import AttentionMetadata, PackedSeqs
from pagedserve.worker.input_batch import (InputBatch, graph_region, graph_region_size, layout_graph_decode,
                                            layout_graph_mixed, mixed_region, mixed_region_size)

log = logging.getLogger(__name__)


class GraphCaptureError(RuntimeError):
    """A bucket's graph could not be captured (the caller runs that step, and the ones after, eagerly)."""


def _checked_sizes(sizes: list[int], limit: int, what: str) -> list[int]:
    if sizes != sorted(set(sizes)) or sizes[0] < 1 or sizes[-1] > limit:
        raise ValueError(f"capture sizes must ascend from >= 1 to at most {limit} {what}, got {sizes}")
    return list(sizes)


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


class BucketGraphs:
    """One graph per bucket over views of the input batch's device buffer (`region()` takes them): captured on
    first use, replayed after; all dropped when the buffer is re-allocated (checked on each run) or on
    invalidate()."""

    def __init__(self, batch: InputBatch, graph_factory: Callable[[], object],
                 region: Callable[[], tuple[torch.Tensor, ...]], kind: str) -> None:
        self.batch = batch
        self.graph_factory = graph_factory
        self.region = region
        self.kind = kind
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.inputs: tuple[torch.Tensor, ...] | None = None  # region's views, bound on first use
        self._bound = -1  # batch.allocations when the views were taken

    def invalidate(self) -> None:
        self.graphs.clear()
        self.outputs.clear()

    def run(self, size: int, forward_bucket: Callable[[tuple[torch.Tensor, ...], int], torch.Tensor]) -> torch.Tensor:
        """The bucket's graph's output for the step laid out in the region: captured if it is not yet (a failure
        is a GraphCaptureError), else replayed."""
        if self._bound != self.batch.allocations:  # the buffer grew: the graphs read the old one
            self.invalidate()
            self.inputs = self.region()
            self._bound = self.batch.allocations
        if size not in self.graphs:
            graph = self.graph_factory()
            try:
                self.outputs[size] = graph.capture(lambda: forward_bucket(self.inputs, size))
            except Exception as exc:
                raise GraphCaptureError(f"capturing the {self.kind} graph of size {size} failed: {exc}") from exc
            self.graphs[size] = graph
        else:
            self.graphs[size].replay()
        return self.outputs[size]


class DecodeGraphRunner:
    """One graph per capture size for a model's decode steps, reading the input batch's device buffer.

    forward(input_ids, positions, meta) runs the model over the current KV cache (the model runner's)."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 max_num_seqs: int, max_blocks: int, batch: InputBatch,
                 graph_factory: Callable[[], object], groups: int = 1,
                 per_layer: Callable[[list[AttentionMetadata]], object] | None = None,
                 sizes: list[int] | None = None) -> None:
        """groups: the model's KV groups; with several, per_layer maps the groups' metadata to what the
        model takes (the model runner's: each layer its group's). sizes: the row counts to capture
        (GraphPlan.decode_sizes; default capture_sizes(max_num_seqs)), none above max_num_seqs."""
        self.forward = forward
        self.sizes = _checked_sizes(sizes, max_num_seqs, "rows") if sizes else capture_sizes(max_num_seqs)
        self.rows = self.sizes[-1]
        self.max_blocks = max_blocks
        self.batch = batch
        self.graph_factory = graph_factory
        self.groups = groups
        self.per_layer = per_layer
        if groups > 1 and per_layer is None:
            raise ValueError("several KV groups need per_layer")
        self.captured = BucketGraphs(batch, graph_factory, lambda: graph_region(batch, self.rows, max_blocks, groups),
                                     "decode")

    @property
    def graphs(self) -> dict[int, object]:
        return self.captured.graphs

    @property
    def inputs(self) -> tuple[torch.Tensor, ...] | None:
        return self.captured.inputs

    def invalidate(self) -> None:
        """Drop every graph (the KV cache or the input buffer they captured was re-allocated); they
        re-capture on next use."""
        self.captured.invalidate()

    @property
    def region_size(self) -> int:
        """Values of the input buffer the graphs read (graph_region)."""
        return graph_region_size(self.rows, self.max_blocks, self.groups)

    def bucket(self, num_decodes: int) -> int | None:
        """The capture size a pure-decode step of num_decodes sequences runs at, or None (eagerly)."""
        return bucket_for(num_decodes, self.sizes) if num_decodes else None

    def layout(self, decodes: list, size: int, block_size: int, tables=None):
        """A pure-decode step written where the graphs read it (input_batch.layout_graph_decode; tables: the
        states' block-table rows): (input_ids, positions, metadata) of `size` rows, or None when a table is
        wider than the graphs' tables. With several KV groups the metadata is per_layer's."""
        laid = layout_graph_decode(self.batch, decodes, size, self.rows, self.max_blocks, block_size, tables,
                                   self.groups)
        if laid is None or self.groups == 1:
            return laid
        return laid[0], laid[1], self.per_layer(laid[2])

    def run(self, size: int) -> torch.Tensor:
        """The hidden states [size, hidden] of the step `layout` wrote (the rows past its batch are
        padding): the bucket's graph captured if it is not yet, else replayed; no input is copied."""
        return self.captured.run(size, self._forward_bucket)

    def capture_all(self, block_size: int) -> None:
        """Capture every size now, largest first (the smaller reuse its pool memory), each over an idle step
        (every row reads and writes slot 0 of block 0: call it before the cache holds anything)."""
        for size in sorted(self.sizes, reverse=True):
            self.layout([], size, block_size)
            self.run(size)

    def _forward_bucket(self, inputs: tuple[torch.Tensor, ...], size: int) -> torch.Tensor:
        input_ids, positions, slots, seq_lens, tables, *others = (t[:size] for t in inputs)
        metas = [AttentionMetadata(slots, size, tables, seq_lens, None, [])]
        metas += [AttentionMetadata(group_slots, size, group_tables, seq_lens, None, [])
                  for group_slots, group_tables in zip(others[::2], others[1::2])]
        return self.forward(input_ids, positions, metas[0] if self.groups == 1 else self.per_layer(metas))


class MixedGraphRunner:
    """One graph per token size for a model's other steps (the module docstring's mixed-step graphs). Their
    hidden states land in one output buffer [max_tokens, hidden_size] that every graph writes."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 max_num_seqs: int, max_tokens: int, max_blocks: int, batch: InputBatch,
                 graph_factory: Callable[[], object], output: torch.Tensor, groups: int = 1,
                 per_layer: Callable[[list[AttentionMetadata]], object] | None = None,
                 sizes: list[int] | None = None) -> None:
        """groups, per_layer: as DecodeGraphRunner's. sizes: the token counts to capture
        (GraphPlan.mixed_sizes; default mixed_capture_sizes(max_tokens)), none above max_tokens."""
        self.forward = forward
        self.sizes = _checked_sizes(sizes, max_tokens, "tokens") if sizes else mixed_capture_sizes(max_tokens)
        self.tokens = self.sizes[-1]
        self.seqs = max_num_seqs + 1  # room for a padding sequence beside a full batch
        self.max_blocks = max_blocks
        self.batch = batch
        self.output = output
        self.groups, self.per_layer = groups, per_layer
        if groups > 1 and per_layer is None:
            raise ValueError("several KV groups need per_layer")
        self.captured = BucketGraphs(batch, graph_factory,
                                     lambda: mixed_region(batch, self.tokens, self.seqs, max_blocks, groups),
                                     "mixed-step")

    @property
    def graphs(self) -> dict[int, object]:
        return self.captured.graphs

    def invalidate(self) -> None:
        self.captured.invalidate()

    @property
    def region_size(self) -> int:
        """Values of the input buffer the graphs read (mixed_region)."""
        return mixed_region_size(self.tokens, self.seqs, self.max_blocks, self.groups)

    def bucket(self, num_tokens: int, num_seqs: int) -> int | None:
        """The token size a step of num_tokens tokens over num_seqs sequences runs at, or None (eagerly)."""
        if num_seqs >= self.seqs:
            return None
        return bucket_for(num_tokens, self.sizes)

    def layout(self, decodes: list, prefills: list, num_tokens: int, size: int, block_size: int, tables=None):
        """The step written where the graphs read it (input_batch.layout_graph_mixed; tables: the states'
        block-table rows), or None (eagerly). With several KV groups the metadata is per_layer's."""
        laid = layout_graph_mixed(self.batch, decodes, prefills, num_tokens, size, self.tokens, self.seqs,
                                  self.max_blocks, block_size, tables, self.groups)
        if laid is None or self.groups == 1:
            return laid
        return laid[0], laid[1], self.per_layer(laid[2])

    def run(self, size: int) -> torch.Tensor:
        """The hidden states [size, hidden] of the step `layout` wrote (tokens past the step's are padding)."""
        return self.captured.run(size, self._forward_bucket)

    def capture_all(self, block_size: int) -> None:
        """Capture every size now, largest first (the smaller reuse its pool memory), each over an idle step
        (padding only: nothing is written to the cache)."""
        for size in sorted(self.sizes, reverse=True):
            if self.layout([], [], 0, size, block_size) is not None:
                self.run(size)

    def _forward_bucket(self, inputs: tuple[torch.Tensor, ...], size: int) -> torch.Tensor:
        input_ids, positions, slots = (t[:size] for t in inputs[:3])
        seq_lens, query_start_loc, tables, *others = inputs[3:]
        group_views = [(slots, tables), *zip((t[:size] for t in others[::2]), others[1::2])]
        metas = [AttentionMetadata(group_slots, 0, None, None, None, [],
                                   packed=PackedSeqs(query_start_loc, seq_lens, group_tables))
                 for group_slots, group_tables in group_views]
        out = self.output[:size]
        out.copy_(self.forward(input_ids, positions, metas[0] if self.groups == 1 else self.per_layer(metas)))
        return out

"""Decode steps replayed from captured graphs (CUDA graphs on a GPU; a stand-in that runs the same code on
the CPU, so tests exercise everything but the capture itself).

A pure-decode step of batch b runs as the graph captured for the smallest capture size >= b (1, 2, 4, 8,
then every 8 up to max_num_seqs, as vLLM captures). A graph reads only its static buffers: token ids,
positions, slot mapping, block tables (max_blocks wide, zero-padded) and sequence lengths, sized once for
the largest bucket; a step copies its inputs (already on the device: views of the input batch,
input_batch.py) into them, device to device with no host read, and replays. The attention backends
build what else they need (the torch backend's mask) from these inside the graph. The rows past b
repeat row 0 exactly (its token, position, slot, table and length): they compute the same keys and
values as row 0 and write them into row 0's slot, so a padding row never touches another sequence's
block, and their outputs are dropped.

Graphs are captured after the KV cache is allocated, lazily on the first decode step that needs a bucket,
and dropped (re-captured on next use) when the cache is re-allocated: a graph holds the cache's
addresses. Steps with prefills, sliding-window or hybrid KV groups, or more sequences than the largest
bucket run eagerly, and so does every step of a model whose attention backend cannot be captured (its
`graph_support`, attention.GraphSupport: the model runner asks before it builds this runner).

Threads: used only from the worker's torch thread (the model runner's), like the model itself."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from pagedserve.worker.attention import AttentionMetadata

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
    """Static buffers and one graph per capture size for a model's decode steps.

    forward(input_ids, positions, meta) runs the model over the current KV cache (the model runner's)."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 max_num_seqs: int, max_blocks: int, device: torch.device,
                 graph_factory: Callable[[], object]) -> None:
        self.forward = forward
        self.sizes = capture_sizes(max_num_seqs)
        self.device = device
        self.graph_factory = graph_factory
        rows = self.sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.long, device=device)
        self.tables = torch.zeros(rows, max_blocks, dtype=torch.long, device=device)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_blocks(self) -> int:
        return self.tables.shape[1]

    def invalidate(self) -> None:
        """Drop every graph (the KV cache they captured was re-allocated); they re-capture on next use."""
        self.graphs.clear()
        self.outputs.clear()

    def can_run(self, meta, num_tokens: int) -> bool:
        """A pure-decode step with one KV group, no window, a batch a bucket holds, tables that fit."""
        return (isinstance(meta, AttentionMetadata) and not meta.prefills and meta.num_decodes == num_tokens
                and not meta.decode_windowed and bucket_for(num_tokens, self.sizes) is not None
                and meta.decode_block_tables.shape[1] <= self.max_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states [b, hidden]: its inputs copied into the static buffers (rows past b
        repeat row 0), the bucket's graph captured if it is not yet, then replayed."""
        batch = input_ids.shape[0]
        size = bucket_for(batch, self.sizes)
        self._stage(input_ids, positions, meta, batch, size)
        if size not in self.graphs:
            graph = self.graph_factory()
            try:
                self.outputs[size] = graph.capture(lambda: self._forward_bucket(size))
            except Exception as exc:
                raise GraphCaptureError(f"capturing the decode graph of batch size {size} failed: {exc}") from exc
            self.graphs[size] = graph
        else:
            self.graphs[size].replay()
        return self.outputs[size][:batch]

    def _stage(self, input_ids, positions, meta: AttentionMetadata, batch: int, size: int) -> None:
        """The step's rows into the static buffers, device to device; rows batch..size repeat row 0."""
        width = meta.decode_block_tables.shape[1]
        columns = (input_ids, positions, meta.slot_mapping, meta.decode_seq_lens)
        for buffer, values in zip((self.input_ids, self.positions, self.slots, self.seq_lens), columns):
            buffer[:batch].copy_(values)
            buffer[batch:size].copy_(values[:1].expand(size - batch))
        self.tables[:batch, :width].copy_(meta.decode_block_tables)
        self.tables[:batch, width:].zero_()
        self.tables[batch:size].copy_(self.tables[:1].expand(size - batch, -1))

    def _forward_bucket(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(self.slots[:size], size, self.tables[:size], self.seq_lens[:size], None, [])
        return self.forward(self.input_ids[:size], self.positions[:size], meta)

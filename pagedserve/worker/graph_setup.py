"""Which of a model runner's steps replay graphs, and their capture (graph_runner.py has the runners): a model
whose attention backends can be captured gets decode graphs; mixed-step graphs too where every backend says
MIXED and the model reads no layout on the host. With several KV groups, each layer is given its group's
metadata. Functions of the model runner (worker/model_runner.py), which keeps the runners they return.

Threads: the model runner's torch thread only."""

from __future__ import annotations

import logging
import time

import torch

from pagedserve.common.compilation import GraphPlan
from pagedserve.worker.attention import AttentionBackend, GraphSupport
from pagedserve.worker.graph_runner import DecodeGraphRunner, GraphCaptureError, MixedGraphRunner
from pagedserve.worker.mla_attention import MLAAttentionBackend

log = logging.getLogger("pagedserve.worker.model_runner")


def graph_runners(runner, max_num_seqs: int, graph_factory, max_num_batched_tokens: int = 0,
                  plan: GraphPlan | None = None) -> tuple[DecodeGraphRunner | None, MixedGraphRunner | None]:
    """(decode graphs, mixed-step graphs) for the runner's model: pure-decode steps of up to max_num_seqs
    sequences, and with max_num_batched_tokens the other steps up to that many tokens, as the module docstring
    says, at the sizes plan gives (--compilation-config; default: every size); None for what runs eagerly (a
    backend whose graph_support is short of PURE_DECODE: everything; a plan with no size for them)."""
    plan = plan or GraphPlan(True, True)
    decode_sizes, mixed_sizes = plan.decode_sizes(max_num_seqs), plan.mixed_sizes(max_num_batched_tokens)
    if not decode_sizes:
        return None, None
    groups = runner.kv.groups
    backends = {type(m.backend) for m in runner.model.modules()
                if isinstance(getattr(m, "backend", None), (AttentionBackend, MLAAttentionBackend))}
    if any(b.graph_support < GraphSupport.PURE_DECODE for b in backends):
        log.info("decode steps run eagerly: attention backend(s) %s cannot be captured",
                 sorted(b.__name__ for b in backends if b.graph_support < GraphSupport.PURE_DECODE))
        return None, None
    forward = lambda ids, positions, meta: runner.model(ids, positions, runner.kv.model_caches(), meta)  # noqa: E731
    max_blocks = -(-runner.max_model_len // runner.block_size)
    num_groups = len(groups.layers) if groups.hybrid else 1
    decode = DecodeGraphRunner(forward, max_num_seqs, max_blocks, runner.input_batch, graph_factory, num_groups,
                               runner._per_layer, decode_sizes)
    if not mixed_sizes or runner.model.reads_layout_on_host \
            or any(b.graph_support < GraphSupport.MIXED for b in backends):
        return decode, None
    output = torch.empty(max_num_batched_tokens, runner.config.hidden_size, dtype=runner.dtype, device=runner.device)
    return decode, MixedGraphRunner(forward, max_num_seqs, max_num_batched_tokens, max_blocks, runner.input_batch,
                                    graph_factory, output, num_groups, runner._per_layer, mixed_sizes)


def capture_all(runner) -> tuple[DecodeGraphRunner | None, MixedGraphRunner | None]:
    """Capture every graph of the runner's now, over idle steps (before the cache holds anything: a decode
    graph's idle step writes slot 0 of block 0), the mixed-step graphs first (the largest steps: the rest reuse
    their pool). Returns the runners still standing: one whose capture fails is dropped (its steps run eagerly).
    The input buffer first grows to hold every graph's region: growing between two captures would drop the
    graphs captured before (they read the old buffer)."""
    decode, mixed = runner.decode_graphs, runner.mixed_graphs
    runners = [g for g in (decode, mixed) if g is not None]
    if not runners:
        return decode, mixed
    runner.input_batch.begin(max(g.region_size for g in runners))
    start, cuda = time.perf_counter(), runner.device.type == "cuda"
    reserved = torch.cuda.memory_reserved(runner.device) if cuda else 0
    kept = []
    for graphs in (mixed, decode):
        if graphs is not None:
            try:
                graphs.capture_all(runner.block_size)
            except GraphCaptureError as exc:
                log.warning("%s; those steps run eagerly (--enforce-eager says so up front)", exc)
                graphs = None
        kept.append(graphs)
    mixed, decode = kept
    grown = (torch.cuda.memory_reserved(runner.device) - reserved) / 2**30 if cuda else 0.0
    log.info("graphs captured in %.1f s: %d decode sizes, %d mixed-step sizes (the device's reserved memory "
             "+%.2f GiB)", time.perf_counter() - start, len(decode.graphs) if decode else 0,
             len(mixed.graphs) if mixed else 0, grown)
    return decode, mixed

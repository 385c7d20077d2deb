"""Runs one engine step: applies the scheduler's delta to the cached request state, builds the
flattened batch, runs the model over the paged KV cache and samples. Makes no scheduling decision.
With a draft model (enable_draft; worker/draft_model.py) the draft runs each step's positions
first and fills in the proposals the step verifies. A vision-language model's steps whose positions
cover images' placeholders run eagerly, with those rows' embeddings from the images (image_rows.py); an M-RoPE
model's (Qwen2-VL) positions are shifted in every layout and given in three sections there (mrope.py)."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
import torch

from pagedserve.common.compilation import GraphPlan
from pagedserve.common.messages import ModelRunnerOutput, SchedulerOutput
from pagedserve.common.model_config import ModelConfig
from pagedserve.common.stop_rules import samples_any
from pagedserve.worker.attention import AttentionMetadata, PrefillSeq
from pagedserve.worker.cpu_linear import pack_model
from pagedserve.worker import graph_setup
from pagedserve.worker.graph_runner import CudaGraph, DecodeGraphRunner, GraphCaptureError, MixedGraphRunner
from pagedserve.worker.input_batch import InputBatch, layout_step
from pagedserve.worker.kv_cache import KVCache, bytes_per_block
from pagedserve.worker.models import model_class
from pagedserve.worker import image_rows, mrope, pooling, prompt_logprobs, spec_verify, step_overlap
from pagedserve.worker.process_group import TPGroup, broadcast_from_rank0, tp_group, using_group
from pagedserve.worker.platform import platform_for
from pagedserve.worker.request_states import RequestState, RequestStates
from pagedserve.worker.step_overlap import StepInFlight
from pagedserve.worker.sampler import Sampler, to_device
from pagedserve.worker.step_sampling import StepSampling
from pagedserve.worker.structured_output import IDLE_WAIT_S, GrammarMatchers
from pagedserve.worker.weight_loading import load_linear_weights

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, model_path: str | Path, dtype: torch.dtype,
                 device: torch.device, block_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], progress: bool = True, quantization: str = "auto") -> None:
        self.config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.platform = platform_for(device)
        self.tp = tp_group()  # the group this model was sharded for; made current while it runs
        self.tensor_parallel_size = self.tp.world_size
        # Parameters are made in the serving dtype (no float32 copy first); tables stay float32.
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):  # the models take their ops and backends from this device's platform
                model = model_class(model_config.architecture)(model_config, self.platform.attention_backend(),
                                                               max_model_len)
        finally:
            torch.set_default_dtype(previous_dtype)
        # vLLM's names of a checkpoint's method mean auto, or are refused; a draft model takes the result
        self.requested_quantization, self.quantization, self.weights_description = load_linear_weights(
            model, model_config, model_path, quantization, device, dtype, progress)
        pack_model(model, device, dtype)
        self.model = model.eval()
        self.kv: KVCache | None = None
        self.decode_graphs: DecodeGraphRunner | None = None  # enable_decode_graphs
        self.mixed_graphs: MixedGraphRunner | None = None  # enable_decode_graphs with a token budget
        self._graph_size: int | None = None  # the bucket the step _prepare laid out runs at (a decode graph)
        self._mixed_size: int | None = None  # ... or the token size (a mixed-step graph)
        self.sampler = Sampler()
        self.input_batch = InputBatch(device)  # the step's integer inputs, persistent (input_batch.py)
        self.input_batch.rope_shift = mrope.position_shift(model_config.vision)  # M-RoPE's (mrope.py), else None
        self.requests = RequestStates()
        self._unfinished: list[StepInFlight] = []  # steps begun whose tokens are not yet taken (<= 2)
        self.held_rows = 0  # rows fed from a step in flight's sampled ids (step_overlap.py), summed
        self.grammars = GrammarMatchers(model_path, model_config.vocab_size, eos_token_ids)
        self.sampling = StepSampling(self.sampler, self.grammars, eos_token_ids, device)  # step_sampling.py
        self.lora = None  # a lora.manager.LoraManager once enable_lora ran (--enable-lora)
        self.drafts = False  # enable_draft ran: rank 0's draft model fills in the steps' proposals
        self.drafter = None  # the draft_model.DraftModel, on rank 0

    def enable_draft(self, model_path: str | Path) -> None:
        """Speculate with a draft model (--speculative-config method draft_model; its files checked
        already: model_files/draft_check.py). Rank 0 loads it unsharded, in the target's dtype and
        quantization; the other ranks take its proposals from a broadcast. Before the KV pool is
        sized and allocated: its blocks hold the draft's K/V too."""
        from pagedserve.worker.draft_model import DraftModel
        if self.config.vision is not None:
            raise ValueError("speculative decoding with a draft model is not supported for a vision-language model")
        self.drafts = True
        if self.tp.rank != 0:
            return
        with using_group(TPGroup()):
            draft = ModelRunner(ModelConfig.from_folder(model_path), model_path, self.dtype, self.device,
                                self.block_size, self.max_model_len, self.eos_token_ids, progress=False,
                                quantization=self.requested_quantization)
        self.drafter = DraftModel(draft)
        log.info("draft model %s loaded (linear weights %s)", Path(model_path).name, draft.weights_description)

    def kv_block_bytes(self, block_size: int) -> int:
        """One block's bytes on this rank: the target's cache and the draft's."""
        own = bytes_per_block(self.config, block_size, self.dtype, self.tensor_parallel_size)
        return own + (self.drafter.block_bytes(block_size) if self.drafter is not None else 0)

    def enable_lora(self, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        """Serve LoRA adapters (worker/lora): every adaptable layer gets its slots' stacks; decode
        steps run eagerly (a step's rows change slots)."""
        from pagedserve.worker.lora.manager import LoraManager
        with using_group(self.tp):
            self.lora = LoraManager(self.model, max_loras, max_lora_rank, max_cpu_loras, self.dtype, self.device)
        self.decode_graphs = self.mixed_graphs = None

    def remove_lora(self, name: str) -> bool:
        return self.lora is not None and self.lora.remove(name)

    def weight_bytes(self) -> int:
        quant = sum(m.quant.nbytes for m in self.model.modules() if getattr(m, "quant", None) is not None)
        draft = self.drafter.runner.weight_bytes() if self.drafter is not None else 0
        return draft + quant + sum(p.numel() * p.element_size() for p in self.model.parameters())

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.kv = KVCache(self.config, num_blocks, self.block_size, self.dtype, self.device, num_host_blocks,
                          self.tensor_parallel_size)
        for graphs in (self.decode_graphs, self.mixed_graphs):  # they captured the old cache's addresses
            if graphs is not None:
                graphs.invalidate()
        if self.drafter is not None:  # the same block ids address the draft's cache
            self.drafter.allocate(num_blocks, num_host_blocks)

    def use_decode_graphs(self, max_num_seqs: int, enforce_eager: bool, max_num_batched_tokens: int = 0,
                          plan: GraphPlan | None = None) -> None:
        """On CUDA, unless enforce_eager: decode steps of up to max_num_seqs sequences and other steps of up to
        max_num_batched_tokens tokens replay CUDA graphs (one memory pool for all of them) at plan's sizes
        (--compilation-config), every graph captured now (again after the cache is re-allocated). The CPU runs
        every step eagerly."""
        if self.device.type != "cuda" or enforce_eager or self.lora is not None:
            return
        if self.decode_graphs is None:
            pool = torch.cuda.graph_pool_handle()
            self.enable_decode_graphs(max_num_seqs, lambda: CudaGraph(pool), max_num_batched_tokens, plan)
        self.capture_graphs()

    def enable_decode_graphs(self, max_num_seqs: int, graph_factory, max_num_batched_tokens: int = 0,
                             plan: GraphPlan | None = None) -> None:
        """Steps replay graphs from now on, where the model and its backends allow (graph_setup.graph_runners):
        graph_factory() makes a CudaGraph on a GPU or a StandInGraph on the CPU (tests)."""
        self.decode_graphs, self.mixed_graphs = graph_setup.graph_runners(self, max_num_seqs, graph_factory,
                                                                          max_num_batched_tokens, plan)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture every graph now (graph_setup.capture_all); a runner whose capture fails is dropped."""
        with using_group(self.tp):
            self.decode_graphs, self.mixed_graphs = graph_setup.capture_all(self)

    def profile_peak_activation_bytes(self, num_tokens: int) -> int:
        """CUDA: run the largest step the budget allows (one prompt of num_tokens, no cache yet), then sample
        256 of its rows the costliest way (StepSampling.profile: a full batch's sampler temporaries, a
        [rows, vocabulary] tensor several times over), and return the memory either peaked at above the
        weights. (The graphs' reserve is scaled from it: where the sampler's peak is the larger, a little
        more than the graphs need.)"""
        if self.device.type != "cuda":
            return 0
        with using_group(self.tp):
            peak = self._profile_peak(num_tokens)
        if self.drafter is not None:  # its passes run before the target's, not beside it
            peak = max(peak, self.drafter.runner.profile_peak_activation_bytes(num_tokens))
        return peak

    @torch.inference_mode()
    def _profile_peak(self, num_tokens: int) -> int:
        scratch = KVCache(self.config, 1, self.block_size, self.dtype, self.device,
                          tensor_parallel_size=self.tensor_parallel_size)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.model.cos_table.shape[0]
        slots = torch.zeros(num_tokens, dtype=torch.long, device=self.device)  # all tokens share one slot
        meta = AttentionMetadata(slots, 0, None, None, None,
                                 [PrefillSeq(0, num_tokens, 0, torch.zeros(1, dtype=torch.long, device=self.device))])
        _images = image_rows.profile_rows(self.model, self.config.vision, num_tokens)  # live over the forward
        hidden = self.model(ids, positions, scratch.model_caches(), meta)
        logits = self.model.compute_logits(hidden[-256:])
        if self.tp.rank == 0:  # (rank 0 samples) the costliest sampling of that many rows: its temporaries too
            try:
                self.sampling.profile(logits)
            except Exception:  # noqa: BLE001 - the budget then leaves the sampler out; the worker still starts
                log.exception("the memory profile's sampling failed: the KV budget leaves the sampler's memory out")
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del scratch, hidden, logits
        torch.cuda.empty_cache()
        return int(peak)

    # ---- state ---------------------------------------------------------------------------
    def _apply_delta(self, step: SchedulerOutput) -> None:
        self.requests.apply(step, self.kv_block_ops)

    def kv_block_ops(self, step: SchedulerOutput) -> None:
        """The step's block operations on this runner's cache (and its draft's)."""
        # Swap-outs first: their device blocks may be handed to other requests in this same step.
        self.kv.swap_out(step.blocks_to_swap_out)
        self.kv.swap_in(step.blocks_to_swap_in)
        self.kv.copy_blocks(step.blocks_to_copy)
        if self.drafter is not None:
            self.drafter.block_ops(step)

    def _state(self, req_id: str) -> RequestState:
        return self.requests.state(req_id)

    # ---- batch layout --------------------------------------------------------------------
    def _prepare(self, step: SchedulerOutput):
        """The step's flattened inputs (views of the persistent input batch: input_batch.py) and its
        AttentionMetadata: one object, or with KV groups a list with each layer's group's (slot mapping
        and tables differ per group). A pure-decode step a decode graph runs is laid out where the graphs
        read it, padded to its bucket (self._graph_size, else None)."""
        decodes = [(self._state(r), n) for r, n in step.num_scheduled_tokens.items() if n == 1]
        prefills = [(self._state(r), n) for r, n in step.num_scheduled_tokens.items() if n > 1]
        order = [s for s, _ in decodes] + [s for s, _ in prefills]
        counts = [1] * len(decodes) + [n for _, n in prefills]
        graphs, mixed, self._graph_size, self._mixed_size = self.decode_graphs, self.mixed_graphs, None, None
        if self.config.vision is not None and image_rows.has_image_rows(order, counts):
            graphs = mixed = None  # image rows: an eager step (image_rows.py)
        rows = self.requests.tables  # the states' block tables, kept in step with the deltas
        num_tokens = step.total_num_scheduled_tokens
        if prefills and mixed is not None:  # a mixed or prefill step a mixed-step graph runs
            size = mixed.bucket(num_tokens, len(order))
            laid = mixed.layout(decodes, prefills, num_tokens, size, self.block_size, rows) if size else None
            if laid is not None:
                self._mixed_size = size
                return *laid, order, counts
        size = graphs.bucket(len(decodes)) if graphs is not None and not prefills else None
        laid = graphs.layout(decodes, size, self.block_size, rows) if size else None
        if laid is not None:
            self._graph_size = size
            return *laid, order, counts
        input_ids, positions, metas = layout_step(self.input_batch, decodes, prefills, num_tokens, self.kv.groups,
                                                  self.block_size, tables=rows)
        if graphs is None and self.config.vision is not None:  # an image's placeholders may see each other
            image_rows.mark_key_limits(metas, order, counts, positions, self.config.vision)
        return input_ids, positions, self._per_layer(metas), order, counts

    def batch_metadata(self, decodes, prefills, positions: np.ndarray):
        """The AttentionMetadata of a batch laid out as _prepare lays it (decodes first, then each
        prefill's run of positions): one object, or with KV groups one per layer (its group's).
        decodes and prefills are (state, num_tokens) pairs; a state needs num_computed_tokens,
        block_ids and group_block_ids. bench quality lays out its teacher-forced windows with it."""
        _, _, metas = layout_step(self.input_batch, decodes, prefills, len(positions), self.kv.groups,
                                  self.block_size, positions)
        return self._per_layer(metas)

    def _per_layer(self, metas: list[AttentionMetadata]):
        """One KV group's metadata as it is, or with KV groups each layer's group's."""
        groups = self.kv.groups
        if not groups.hybrid:
            return metas[0]
        slot_of = groups.slot_of()
        return [metas[slot_of[layer][0]] for layer in range(len(slot_of))]

    # ---- one step ------------------------------------------------------------------------
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step to its tokens (begin, then finish)."""
        return self.finish(self.begin(step))

    def begin(self, step: SchedulerOutput) -> StepInFlight:
        """Launch a step's forward and sampling; finish() takes its tokens. A step begun while the one
        before it is still in flight (the engine's async scheduling: step_overlap.py) feeds the rows
        that one samples for from the device; when a row needs its token on the host first, the step
        before is finished here."""
        with using_group(self.tp):
            return self._begin(step)

    def finish(self, handle: StepInFlight) -> ModelRunnerOutput:
        """The step's result: waits for its sampled ids and commits them (once; again returns the same)."""
        with using_group(self.tp):
            return self._finish(handle)

    @torch.inference_mode()
    def _begin(self, step: SchedulerOutput) -> StepInFlight:
        while len(self._unfinished) > 1:  # depth one: only the step just before may still be in flight
            self._finish(self._unfinished[0])
        before = self._unfinished[0] if self._unfinished else None
        if before is not None and not step_overlap.can_follow(before, step, self):
            self._finish(before)
            before = None
        self._apply_delta(step)
        failed = self.lora.unloadable(step.num_scheduled_tokens, self.requests) if self.lora is not None else {}
        failed.update(image_rows.unservable(step.new_requests, self.config.vision, step, self.requests))
        if failed:  # an adapter that did not load, images the model cannot take: they run nothing, and fail alone
            step = dataclasses.replace(step, num_scheduled_tokens={
                r: n for r, n in step.num_scheduled_tokens.items() if r not in failed})
        result = ModelRunnerOutput(step.step_id, {}, failed=failed)
        samples_here = tp_group().rank == 0  # only rank 0 samples, so only it compiles grammars
        if step.grammars and samples_here:
            self.grammars.compile_ahead(step.grammars)
        if not step.num_scheduled_tokens:  # (while only requests waiting for grammars are left: the poll)
            if samples_here:
                result.grammars_ready = self.grammars.take_ready(wait_s=IDLE_WAIT_S)
            return self._track(StepInFlight(result, None, []))
        held = step_overlap.hold_places(before, step, self.requests) if before is not None else {}
        t0 = time.perf_counter()
        if self.drafts:
            self._draft(step)
        input_ids, positions, meta, order, counts = self._prepare(step)
        if held:  # their token ids: the step in flight's samples, device to device
            self.held_rows += len(held)
            step_overlap.feed(input_ids, order, held, before.sampled_ids, self._graph_size)
        if self.lora is not None:
            self.lora.prepare(order, counts)
        hidden = None
        if self._graph_size is not None:  # padded to its bucket: the rows past the step's are dropped
            try:
                hidden = self.decode_graphs.run(self._graph_size)
            except GraphCaptureError as exc:  # never seen on a GPU yet: run eagerly rather than stop serving
                log.warning("%s; decode steps run eagerly from now on (--enforce-eager says so up front)", exc)
                self.decode_graphs = None
        elif self._mixed_size is not None:  # packed and padded: the eager model runs the same layout if need be
            try:
                hidden = self.mixed_graphs.run(self._mixed_size)
            except GraphCaptureError as exc:
                log.warning("%s; mixed steps run eagerly from now on (--enforce-eager says so up front)", exc)
                self.mixed_graphs = None
        if hidden is None:  # (image rows: their embeddings, an M-RoPE model's three positions)
            extra = image_rows.step_inputs(self.model, order, counts, input_ids) if self.config.vision else {}
            hidden = self.model(input_ids, positions, self.kv.model_caches(), meta, **extra)
        hidden = hidden[:step.total_num_scheduled_tokens]
        ends = np.cumsum(counts) - 1
        samplers = [i for i, (s, n) in enumerate(zip(order, counts))
                    if s.num_computed_tokens + n == len(s.token_ids) + len(s.spec_token_ids) and samples_any(s.params)]
        pending = None
        states = [order[i] for i in samplers]
        if samplers:
            rows = spec_verify.logit_rows(ends, samplers, order) if step.spec_token_ids else ends[samplers]
            # every row, in order (a pure-decode step): no index to copy up, no gather
            every = len(rows) == hidden.shape[0] and rows[-1] == len(rows) - 1
            logits = self.model.compute_logits(hidden if every else hidden[to_device(rows, torch.long, self.device)])
            t1 = time.perf_counter()
            result.forward_time_s = t1 - t0
            if tp_group().rank == 0:
                pending = self.sampling.sample(logits, states)
            if self.tp.world_size > 1:
                pending = self.sampling.share(pending, states)
            result.sample_time_s = time.perf_counter() - t1
        else:
            result.forward_time_s = time.perf_counter() - t0
        # The step's host work that needs no sampled token, while the device finishes and the ids come back.
        if any(s.params.prompt_logprobs is not None for s in order):
            result.prompt_logprobs = prompt_logprobs.compute(self.model, hidden, order, counts, tp_group().rank == 0)
        if any(s.params.pooling is not None for s in order):
            result.pooled = pooling.compute(hidden, order, counts, tp_group().rank == 0)
        self.requests.advance(zip(order, counts))
        return self._track(StepInFlight(result, pending, states))

    def forget_requests(self) -> None:
        """A new session: no request state, and no step in flight (its answer is not wanted)."""
        for handle in self._unfinished:
            handle.done = True
        self._unfinished.clear()
        self.requests.clear()

    def _track(self, handle: StepInFlight) -> StepInFlight:
        self._unfinished.append(handle)
        return handle

    @torch.inference_mode()
    def _finish(self, handle: StepInFlight) -> ModelRunnerOutput:
        result = handle.result
        if handle.done:
            return result
        handle.done = True
        self._unfinished.remove(handle)
        if handle.states:
            t2 = time.perf_counter()
            if handle.pending is not None:
                result.sampled = handle.pending.result()
            result.sample_time_s += time.perf_counter() - t2
        self.requests.commit({req_id: [t.token_id for t in tokens] for req_id, tokens in result.sampled.items()})
        if tp_group().rank == 0:
            result.grammars_ready += self.grammars.take_ready()
        return result

    def _draft(self, step: SchedulerOutput) -> None:
        """The draft model runs the step's positions and proposes in place of the scheduler's
        placeholders (draft_model.py); with TP, rank 0's proposals go to every rank."""
        scheduled = [(self._state(r), n) for r, n in step.num_scheduled_tokens.items()]
        if self.drafter is not None:
            self.drafter.run(scheduled)
        speculating = [s for s, _ in scheduled if s.spec_token_ids]
        if self.tp.world_size > 1 and speculating:
            flat = [t for s in speculating for t in s.spec_token_ids]
            ids = broadcast_from_rank0(torch.tensor(flat, dtype=torch.int64, device=self.device)).tolist()
            start = 0
            for state in speculating:
                k = len(state.spec_token_ids)
                state.spec_token_ids, start = ids[start:start + k], start + k

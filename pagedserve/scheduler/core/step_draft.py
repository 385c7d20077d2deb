"""The step Scheduler.schedule() is building (StepDraft, one per step): the token budget it has
left, each scheduled request's entry (new or cached) and copy-on-write pairs, which rows are decodes
(StepStats), why the waiting queue stopped; and what fits in it: a waiting request admitted
(admit: its prefix cache hits, the unchunked prefill that waits for room, the KV watermark, the
step's share of new images' pixels), a
swapped one brought back (swap_in), each against max_num_seqs, --max-loras and the free blocks,
and a decode row's speculative proposals (proposals); a running request preempted to make room
(preempt: swapped out or back to waiting). The Scheduler decides the order, whom to preempt and
what fails; this records what it scheduled (record).

Threads: the scheduler's only. A draft lives for one schedule() call; it holds the Scheduler's
queues and block manager (the same objects, not copies) and moves requests between them.

Invariants: budget is max_num_batched_tokens less the tokens of every request in the step's
num_scheduled_tokens (whatever the Scheduler takes back out of the step, it gives back here); below 0 only
when a whole image went past it (chunk: SchedulerConfig.whole_images), and then nothing more is scheduled;
a request admitted or swapped in is in running, sorted by the queues' key, and has its entry.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from pagedserve.common.messages import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.common.stop_rules import at_length, samples_any
from pagedserve.scheduler.core.block_manager import Allocation, BlockManager, cdiv
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.image_chunks import chunk_images
from pagedserve.scheduler.core.kv_groups import step_entry
from pagedserve.scheduler.core.request import Request, RequestStatus
from pagedserve.scheduler.core.short_first import is_short
from pagedserve.scheduler.core.speculation import Speculation

# The pixels of the requests a step admits (each new request's images travel in the step's message, whose
# gRPC cap is 64 MiB: common/grpc_util.py); a request that would pass it waits for the next step, unless
# it is the step's first with images.
MAX_STEP_IMAGE_BYTES = 32 << 20


def waits_for_result(req: Request, max_model_len: int) -> bool:
    """An ahead step leaves out a request whose next token depends on what the running step
    samples for it beyond the token itself: its n samples fork there, or that token ends it by
    length (known now; running on would be past max_tokens, or past the model's context)."""
    if req.num_spec_tokens:
        return True  # how many tokens its step keeps is known only from its results
    if not req.num_pending_samples:
        return False
    num_output = req.num_output_tokens + req.num_pending_samples
    return bool(req.child_req_ids) or at_length(num_output, req.num_prompt_tokens, req.params, max_model_len)


class StepDraft:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, waiting: list[Request],
                 running: list[Request], swapped: list[Request], key: Callable, step_id: int,
                 speculation: Speculation | None) -> None:
        """speculation: None unless this step may carry proposals (schedule() decides)."""
        self.config, self.block_manager, self.step_id, self.speculation = config, block_manager, step_id, speculation
        self.waiting, self.running, self.swapped, self._key = waiting, running, swapped, key  # sorted by key
        self.budget = config.max_num_batched_tokens
        self.entries: dict[str, NewRequestData | CachedRequestData] = {}
        self.copies: dict[str, list[tuple[int, int]]] = {}
        self.decode_ids: set[str] = set()
        self.wait_reason: str | None = None
        self.num_preempted = 0
        self.image_bytes = 0  # of the requests admitted so far (MAX_STEP_IMAGE_BYTES)

    def chunk(self, num_remaining: int, req: Request | None = None, start: int | None = None) -> int:
        """The tokens req computes this step of num_remaining from `start` (default: where its scheduled tokens
        end): the long-prefill cap and the budget left, then, for whole_images, never part of an image
        (image_chunks.py: possibly past the budget, which then goes below 0)."""
        cap = self.config.long_prefill_token_threshold
        if cap and self.config.enable_chunked_prefill:
            num_remaining = min(num_remaining, cap)
        n = min(num_remaining, max(self.budget, 0))
        if n and req is not None and req.images and self.config.whole_images:
            n = chunk_images(req.images, req.num_scheduled_tokens if start is None else start, n)
        return n

    def _num_seqs_after(self, req: Request) -> int:
        # Samples that running requests will fork on their first token count already.
        pending = sum(len(r.child_req_ids) for r in self.running)
        return len(self.running) + pending + 1 + len(req.child_req_ids)

    def _lora_fits(self, req: Request) -> bool:
        """Whether req's adapter (if any) is running already or one more fits --max-loras."""
        name = req.params.lora_name
        if not name:
            return True
        running = {r.params.lora_name for r in self.running if r.params.lora_name}
        if name in running or len(running) < self.config.max_loras:
            return True
        self.wait_reason = "seq_budget"
        return False

    def admit(self, req: Request, out: SchedulerOutput) -> bool:
        cfg, bm = self.config, self.block_manager
        if self._num_seqs_after(req) > cfg.max_num_seqs:
            self.wait_reason = "seq_budget"
            return False
        if not self._lora_fits(req):
            return False
        if req.images and self.image_bytes and self.image_bytes + req.image_bytes > MAX_STEP_IMAGE_BYTES:
            self.wait_reason = "token_budget"  # the step's other budget: the pixels its message carries
            return False
        # A cached prefix computes no logits or hidden states: a request that reads them (prompt
        # logprobs, mean/cls pooling) takes no hits (as vLLM does); it still fills the cache for others.
        hits = (bm.find_cached_prefix(req.request_id, req.token_ids, req.params.prefix_salt,
                                      req.block_extras(cfg.block_size))
                if req.params.takes_prefix_hits else [])
        num_computed = len(hits) * cfg.block_size
        num_new = req.num_tokens - num_computed
        # Unchunked prefill waits for a step with room, unless no step could ever hold it
        # (a request resumed after preemption carries its outputs too): then it goes in chunks.
        if not cfg.enable_chunked_prefill and self.budget < num_new <= cfg.max_num_batched_tokens:
            self.wait_reason = "token_budget"
            return False
        num_new = self.chunk(num_new, req, num_computed)
        # The watermark keeps headroom for running decodes; with none running it would only
        # keep a prompt that needs the whole pool out forever.
        result = bm.allocate(req.request_id, num_computed, num_new, hits, reserve_watermark=bool(self.running))
        if result is None:
            self.wait_reason = "no_blocks"
            return False
        bm.record_prefix_query(req.num_tokens, num_computed)
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_computed
        self.waiting.remove(req)
        req.num_computed_tokens = num_computed
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=self._key)
        self.record(req, num_new, result, out)
        self.image_bytes += req.image_bytes
        return True

    def swap_in(self, req: Request, out: SchedulerOutput) -> bool:
        bm = self.block_manager
        if self._num_seqs_after(req) > self.config.max_num_seqs:
            self.wait_reason = "seq_budget"
            return False
        if not self._lora_fits(req):
            return False
        num_new = self.chunk(req.num_tokens - req.num_computed_tokens, req, req.num_computed_tokens)
        total = req.num_computed_tokens + num_new
        extra = max(0, cdiv(total, bm.block_size) - len(bm.cpu_tables[req.request_id]))
        if not bm.can_swap_in(req.request_id, extra):
            self.wait_reason = "no_blocks"
            return False
        out.blocks_to_swap_in.extend(bm.swap_in(req.request_id))
        result = bm.allocate(req.request_id, req.num_computed_tokens, num_new)
        assert result is not None, "swap-in reserved the blocks it needs"
        self.swapped.remove(req)
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=self._key)
        self.record(req, num_new, result, out, whole_table=True)
        return True

    def take_from(self, queues: list[tuple[list[Request], Callable]], short_cap: int | None, out: SchedulerOutput,
                  fail: Callable, held: Callable[[Request], bool] = lambda req: False) -> int:
        """Bring requests in from the heads of queues (each with its way in: admit or swap_in) while
        the budget lasts and each fits; short_cap: the step is the short prompts' (short_first.py),
        only prompts of at most that many tokens come in. A request held(req) (its grammar is being
        compiled: grammar_wait.py) is passed over, keeping its place. A request whose way in raises
        is handed to fail(req, exc, out) and fails alone. Returns how many came in."""
        admitted = 0
        for queue, take in queues:
            at = 0  # the queue's requests before this one are held
            while at < len(queue) and self.budget > 0:
                req = queue[at]
                if held(req):
                    at += 1
                    continue
                if short_cap is not None and not is_short(req, short_cap):
                    break
                try:
                    if not take(req, out):
                        break
                    admitted += 1
                except Exception as exc:  # noqa: BLE001 - it fails alone (Scheduler.take_failed)
                    fail(req, exc, out)
                    if at < len(queue) and queue[at] is req:
                        break  # could not even be taken out: leave the queue for the next step
        return admitted

    def close(self, out: SchedulerOutput) -> None:
        """The step's entries (new and cached requests) and copy-on-write pairs into out."""
        for entry in self.entries.values():
            (out.new_requests if isinstance(entry, NewRequestData) else out.cached_requests).append(entry)
        out.blocks_to_copy = [pair for pairs in self.copies.values() for pair in pairs]

    def take_back(self, req: Request, out: SchedulerOutput) -> bool:
        """Take req out of the step (preempted or failed after it was scheduled): its tokens back to
        the budget, its entry and copies dropped (a new request's: the worker never hears of it).
        True when the step had made a copy-on-write block for it."""
        if req.request_id not in out.num_scheduled_tokens:
            return False
        self.budget += out.num_scheduled_tokens.pop(req.request_id)
        if isinstance(self.entries.pop(req.request_id, None), NewRequestData):
            req.sent_to_worker = False
        return self.copies.pop(req.request_id, None) is not None

    def preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Make room: the victim leaves running (and this step, if it was in it), swapped out to the
        host pool (--preemption-mode swap, where it can) or back to waiting to run by recompute."""
        self.running.remove(victim)
        victim.num_preemptions += 1
        self.num_preempted += 1
        # (Only synchronous steps preempt: nothing else of the victim's is in flight.)
        victim.num_inflight_tokens = victim.num_pending_samples = victim.num_spec_tokens = 0
        out.spec_token_ids.pop(victim.request_id, None)
        copied_this_step = self.take_back(victim, out)
        bm = self.block_manager
        # A copy-on-write block made this step holds nothing yet: swapping it would lose the copy.
        if (self.config.preemption_mode == "swap" and victim.sent_to_worker and not copied_this_step
                and bm.can_swap_out(victim.request_id)):
            out.blocks_to_swap_out.extend(bm.swap_out(victim.request_id))
            victim.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, victim, key=self._key)
            return
        bm.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        if victim.sent_to_worker:
            out.finished_req_ids.append(victim.request_id)
            victim.sent_to_worker = False
        bisect.insort(self.waiting, victim, key=self._key)

    def proposals(self, req: Request, num_new: int) -> list[int]:
        if self.speculation is None or num_new != 1 or req.num_unscheduled_tokens != 1:
            return []
        return self.speculation.propose(req, self.budget - 1, self.config.max_model_len, self.step_id)

    def record(self, req: Request, num_new: int, alloc: Allocation, out: SchedulerOutput,
               whole_table: bool = False, spec: list[int] = ()) -> None:
        out.num_scheduled_tokens[req.request_id] = num_new
        self.budget -= num_new
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
            req.first_step = self.step_id
        self.entries[req.request_id] = step_entry(self.block_manager, req, alloc, whole_table)
        if spec:
            out.spec_token_ids[req.request_id] = spec
            req.num_spec_tokens = len(spec)
        if (num_new - len(spec) == 1 and req.num_unscheduled_tokens == 1
                and req.num_output_tokens + req.num_pending_samples):
            self.decode_ids.add(req.request_id)  # the next token after a sampled one (StepStats)
        req.num_inflight_tokens += num_new
        if req.num_unscheduled_tokens <= 0 and samples_any(req.params):  # < 0: the row's proposals
            req.num_pending_samples += 1  # the worker samples where the known tokens end
        if not req.sent_to_worker:
            req.sent_to_worker = True
        elif alloc.replaced:
            self.copies[req.request_id] = [(src, dst) for _, _, src, dst in alloc.replaced]

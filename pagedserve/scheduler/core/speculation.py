"""The scheduler's side of speculative decoding (composed into Scheduler when --speculative-config
is set; absent otherwise, so a step without it pays nothing).

What it decides, per decode row of a synchronous step: the proposals (ngram_proposer.py) and how
many may go — at most num_speculative_tokens, the step's token budget left, what max_tokens and
the model's context leave after the token the step samples anyway, and the request's own
acceptance history. It keeps the counts vLLM reports (drafts, draft tokens, accepted tokens,
accepted per position) and each request's own (Request.num_draft_tokens / num_accepted_tokens).

With method draft_model the proposals come from the worker's draft model, which drafts at the
start of the very step that verifies them (worker/draft_model.py): this side decides only how
many a row gets, exactly as for n-gram, and sends that many placeholder ids (DRAFT_PLACEHOLDER)
for the worker to fill in. Everything else (budgets, rollback, counters, backoff) is the same.

Not speculated: rows with structured outputs (the worker's grammar would have to check each
proposal: speculation is off for such rows), rows that fork n samples on this step, and any
row of an ahead step (async scheduling: its token ids lag the worker's by the pending samples;
a row with proposals in flight is left out of ahead steps, step_draft.waits_for_result).

In the step: a row's proposals are budgeted as 1 + k tokens of the step and k more KV slots
(Scheduler: dropped first when blocks run short, before anything is preempted). Scheduler.update()
takes back the rejected ones (settle: num_computed_tokens counts the accepted only; the blocks stay
the request's, written over by its next tokens, and go back to the pool with it) and runs the kept
tokens one by one through the stop rules, stopping at the first that ends the sample.

Turning itself down, globally: a step with disable_by_batch_size running requests or more carries
no proposals (vLLM's rule of that name): on a CPU a batch's verification tokens are not free. Per
request: a request whose step accepted nothing halves its proposal limit; after
two such steps in a row it stops proposing for 2, 4, 8 ... steps (up to max_backoff_steps); any
accepted token resets the pause and doubles the limit back up to num_speculative_tokens. So a
stream whose text does not repeat itself soon runs as plain decodes again.

Threads: the scheduler's only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.common.speculative import SpeculativeConfig
from pagedserve.scheduler.core.ngram_proposer import TokenArrays, propose_ngram
from pagedserve.scheduler.core.request import Request, RequestStatus


DRAFT_PLACEHOLDER = 0  # a proposal the worker's draft model fills in (method draft_model)


@dataclass(slots=True)
class _Backoff:
    limit: int  # most proposals this request makes now
    misses: int = 0  # steps in a row that accepted nothing
    paused_until: int = 0  # no proposals before this step id


@dataclass(slots=True)
class SpecCounters:
    """vLLM's spec_decode counters (cumulative)."""
    num_drafts: int = 0  # rows that carried proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        drafts, drafted, accepted = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                "accepted_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 0.0}


class Speculation:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.arrays = TokenArrays()
        self.backoff: dict[str, _Backoff] = {}
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)

    def begin_step(self, live: dict, num_running: int) -> bool:
        """Forget the sequences that are gone (live: the scheduler's requests by id); whether this
        step may carry proposals at all (num_running: the running requests)."""
        self.arrays.keep_only(live)
        if len(self.backoff) > len(live):
            self.backoff = {i: b for i, b in self.backoff.items() if i in live}
        limit = self.config.disable_by_batch_size
        return not limit or num_running < limit

    def wants_next_step(self, running: list[Request], config, step_id: int) -> bool:
        """Whether step `step_id` should wait for the running step's results instead of going ahead
        (async scheduling): a running request would get proposals in it. An ahead step carries none,
        and once steps go ahead each next one goes ahead too: speculation would stay off for as long
        as the steps are short (a serve stream at one request kept ~1 proposal in 6).
        config: the scheduler's (SchedulerConfig)."""
        limit = self.config.disable_by_batch_size
        if limit and len(running) >= limit:
            return False
        budget, max_len = config.max_num_batched_tokens - 1, config.max_model_len
        return any(self.propose(r, budget, max_len, step_id) for r in running if r.status is RequestStatus.RUNNING)

    def propose(self, req: Request, budget: int, max_model_len: int, step_id: int) -> list[int]:
        """The proposals to verify in this step's row of `req` (a decode), [] for none."""
        params = req.params
        if params.structured_output is not None or req.child_req_ids:
            return []
        backoff = self.backoff.get(req.request_id)
        if backoff is None:
            backoff = self.backoff[req.request_id] = _Backoff(self.config.num_speculative_tokens)
        elif backoff.paused_until > step_id:
            return []
        # The step samples one token anyway; proposals past max_tokens or the context are waste.
        k = min(backoff.limit, budget, params.max_tokens - req.num_output_tokens - 1,
                max_model_len - req.num_tokens - 1)
        if k < 1:
            return []
        cfg = self.config
        if cfg.method == "draft_model":
            return [DRAFT_PLACEHOLDER] * k
        tokens = self.arrays.get(req.request_id, req.token_ids)
        return propose_ngram(tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max, k).tolist()

    def settle(self, req: Request, proposals: list[int], samples, step_id: int) -> int:
        """A row that carried proposals is back (samples: its kept proposals and one more token):
        record what it kept; returns how many slots it rejected."""
        accepted = max(0, len(samples or ()) - 1)
        req.num_spec_tokens = 0
        self.record(req, len(proposals), accepted, step_id)
        return len(proposals) - accepted

    def record(self, req: Request, num_proposed: int, num_accepted: int, step_id: int) -> None:
        """A verified row's outcome: counters, and the request's proposal limit and pause."""
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_proposed
        c.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            c.accepted_per_pos[pos] += 1
        req.num_draft_tokens += num_proposed
        req.num_accepted_tokens += num_accepted
        b = self.backoff.get(req.request_id)
        if b is None:
            return
        full = self.config.num_speculative_tokens
        if num_accepted:
            b.misses = 0
            b.limit = min(full, max(b.limit, 2 * num_accepted, 1))
            return
        b.misses += 1
        b.limit = max(1, b.limit // 2)
        if b.misses >= 2:
            b.paused_until = step_id + min(self.config.max_backoff_steps, 1 << (b.misses - 1))

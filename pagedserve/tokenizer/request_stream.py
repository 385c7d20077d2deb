"""One client request's way through the tokenizer after its prompt is tokenized: subscribe on the
scheduler link, turn each sample's token deltas into text (incremental detokenization, stop
strings), re-attach when the scheduler stream breaks, and leave when done.

Invariants: the caller gets exactly one `accepted` response, then each sample's text in order
with no token twice across re-attaches (skip_tokens = tokens received so far), and one final
response per sample. A stop string that ends one of n samples aborts that sample alone; leaving
the subscription (request done, caller gone, error) aborts whatever still runs, except that a
resumable stream whose caller vanished keeps running for its resume grace.

Threads: the tokenizer's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from pagedserve.common.grpc_util import StatusError
from pagedserve.tokenizer.detokenizer import SampleText
from pagedserve.tokenizer.replica_router import Charge, Target
from pagedserve.tokenizer.scheduler_link import Broken, SchedulerSubscription
from pagedserve.v1 import common_pb2, generate_pb2, scheduler_pb2

log = logging.getLogger("pagedserve.tokenizer")

UNREACHABLE = "the scheduler is not reachable (model still loading?)"
# The scheduler's verdicts on a request that mean it could not serve it now rather than that the
# request failed: after acceptance the request survives them in Redis, so the stream re-attaches.
# INTERNAL is the request's own failure (its record is finished with the error): passed on, not
# retried (a re-attach would find the record ended and answer 200 with finish_reason "abort").
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
RETRY_BACKOFF_S = (0.1, 1.0)


@dataclass(slots=True)
class SampleState:
    text: SampleText
    received: int = 0   # tokens the scheduler sent (skip_tokens when re-attaching)
    forwarded: int = 0  # tokens passed on to the caller (usage.completion_tokens)
    finished: bool = False


@dataclass(slots=True)
class RequestStream:
    """The tokenizer's state of one request; `service` is the TokenizerService that made it."""
    service: object
    request: generate_pb2.GenerateRequest
    schedule: scheduler_pb2.ScheduleRequest
    timings: common_pb2.Timings
    resume_grace_s: float = 0.0  # > 0: the request outlives a vanished caller this long
    samples: list[SampleState] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    accepted_timings: common_pb2.Timings = field(default_factory=common_pb2.Timings)
    sub: SchedulerSubscription | None = None
    target: Target | None = None  # the scheduler (engine replica) the request runs on
    charge: Charge | None = None  # its share of that replica's in-flight tokens (replicas only)
    stopped_by_us: list[int] = field(default_factory=list)  # samples a stop string ended (n > 1)
    detached: bool = False
    responses_done: bool = False  # responses() ran to its end (or raised): the caller had its answer
    # prompt_logprobs of a one-token prompt: the scheduler has no entry to send (nothing predicts
    # that token), so its one entry goes with sample 0's first message from here
    lone_prompt_entry_due: bool = False

    @property
    def request_id(self) -> str:
        return self.schedule.request_id

    # -- the caller's side ------------------------------------------------------------------
    async def responses(self):
        """Yield GenerateResponses; raise StatusError for a status to answer with."""
        caller_gone = False
        try:
            yield await self._accept()
            async for response in self._stream():
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            caller_gone = True
            raise
        finally:
            self.responses_done = not caller_gone
            if caller_gone and self.resume_grace_s > 0:
                self.detach()
            elif not self.detached:
                self.leave()  # done, stop hit with n == 1, caller gone, or an error

    def caller_done(self, cancelled: bool) -> None:
        """The caller's call ended (from its done callback, which runs even if the response
        iterator is never resumed). A call that ended before its responses did lost its caller,
        whatever `cancelled` says: a peer killed outright (kill -9) can end the call with
        cancelled() False, and this callback can run before the iterator is cancelled."""
        if self.resume_grace_s > 0 and (cancelled or not self.responses_done):
            self.detach()
        elif not self.detached:
            self.leave()

    def leave(self) -> None:
        if self.sub is not None:
            self.sub.leave()
        if self.charge is not None:
            self.charge.release()

    async def _route(self, schedule: scheduler_pb2.ScheduleRequest) -> None:
        """Pick the scheduler for schedule (the same replica while it lives; docs/scale-out.md)."""
        target, charge = await self.service.route(schedule)
        if self.charge is not None:
            self.charge.release()
        if self.target is not None and target.id != self.target.id:
            log.info("request %s moves from replica %s to replica %s", self.request_id, self.target.id,
                     target.id)
        self.target, self.charge = target, charge

    # -- acceptance ---------------------------------------------------------------------------
    async def _accept(self) -> generate_pb2.GenerateResponse:
        await self._route(self.schedule)
        self.sub = self.target.link.subscribe(self.schedule)
        first = await self.sub.read()  # raises the scheduler's refusal as StatusError
        if isinstance(first, Broken):
            log.info("scheduler at %s not reachable: %s", self.target.addr, first.details)
            raise StatusError(grpc.StatusCode.UNAVAILABLE, UNREACHABLE)
        if not first.accepted:
            raise StatusError(grpc.StatusCode.INTERNAL, "the scheduler's stream did not start with accepted")
        self.schedule.request_id = first.request_id or self.request_id
        self.prompt_tokens = first.num_prompt_tokens or len(self.schedule.prompt_token_ids)
        self.cached_tokens = first.num_cached_tokens
        self.accepted_timings.CopyFrom(first.timings)
        request, prompt_ids = self.request, list(self.schedule.prompt_token_ids)
        for _ in range(max(1, first.n or request.params.n)):
            self.samples.append(SampleState(SampleText(self.service.tokenizer, prompt_ids,
                                                       request.skip_special_tokens, list(request.stop),
                                                       request.include_stop_str_in_output)))
        log.debug("request %s accepted: %d prompt tokens, n=%d", self.request_id, self.prompt_tokens,
                  len(self.samples))
        accepted = generate_pb2.GenerateResponse(request_id=self.request_id, accepted=True)
        accepted.usage.prompt_tokens = self.prompt_tokens
        if request.echo:
            cut = request.truncate_prompt_tokens  # kept nonzero only when the prompt was cut
            accepted.prompt_text = request.prompt if request.WhichOneof("input") == "prompt" and not cut else \
                self.service.tokenizer.decode(prompt_ids, skip_special_tokens=request.skip_special_tokens)
        if request.return_token_ids:
            accepted.prompt_token_ids.extend(prompt_ids)
        self.lone_prompt_entry_due = len(prompt_ids) == 1 and request.params.HasField("prompt_logprobs")
        return accepted

    # -- the stream ---------------------------------------------------------------------------
    async def _next(self):
        """The next delta, or None when the stream broke (the request may still be running)."""
        try:
            item = await self.sub.read()
        except StatusError as exc:
            if exc.code not in RETRYABLE:
                raise
            return None
        return None if isinstance(item, Broken) else item

    async def _stream(self):
        retry_until = None  # set while the scheduler is away
        while True:
            delta = await self._next()
            if delta is None:
                log.info("request %s: the scheduler stream broke, re-attaching", self.request_id)
                retry_until = retry_until or time.monotonic() + self.service.retry_timeout_s
                await self._reattach(retry_until)
                continue
            if delta.accepted:
                continue
            retry_until = None
            response, stopped = self._on_delta(delta)
            if response is not None:
                yield response
            if all(s.finished for s in self.samples):
                log.debug("request %s finished", self.request_id)
                return
            if stopped:
                self._abort_sample(delta.index)

    def _on_delta(self, delta: scheduler_pb2.TokenDelta):
        """The response for one scheduler delta (None when there is nothing to say), and whether a
        stop string ended a sample the scheduler is still generating."""
        if delta.index >= len(self.samples):
            log.warning("request %s: delta for sample %d of %d ignored", self.request_id, delta.index,
                        len(self.samples))
            return None, False
        # Each field read once: every attribute read on a protobuf message is a lookup by name.
        index, token_ids, reason = delta.index, delta.token_ids, delta.finish_reason
        s = self.samples[index]
        s.received += len(token_ids)
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)  # known once it is scheduled
        if s.finished:
            return None, False
        text, used, stopped = s.text.push(token_ids, final=bool(reason))
        finish = "stop" if stopped else reason
        logprobs, prompt_logprobs = delta.logprobs, delta.prompt_logprobs
        lone_entry = index == 0 and self.lone_prompt_entry_due
        self.lone_prompt_entry_due &= index != 0
        if not finish and not text and not used and not prompt_logprobs and not lone_entry:
            s.forwarded += used
            return None, False  # nothing to say (a token held back whole)
        response = generate_pb2.GenerateResponse(request_id=self.request_id, index=index, text=text,
                                                 token_ids=token_ids[:used])
        if len(logprobs) == len(token_ids):
            for lp in logprobs[:used]:
                self._add_logprob(response.logprobs.add(), lp)
        if prompt_logprobs or lone_entry:
            self._add_prompt_logprobs(response, prompt_logprobs)
        s.forwarded += used
        if not finish:
            return response, False
        s.finished = True
        response.finish_reason = finish
        response.usage.prompt_tokens = self.prompt_tokens
        response.usage.completion_tokens = s.forwarded
        response.usage.cached_tokens = self.cached_tokens
        response.timings.CopyFrom(self.timings)
        response.timings.MergeFrom(self.accepted_timings)
        response.timings.MergeFrom(delta.timings)
        response.timings.detokenized = time.time()
        response.embedding = delta.embedding
        # The scheduler still generates this sample only if it had not finished it itself.
        return response, stopped and not reason

    def _add_prompt_logprobs(self, response: generate_pb2.GenerateResponse, entries) -> None:
        """One entry per prompt token: the first has its token only (nothing predicts it)."""
        first = self.schedule.prompt_token_ids[0]
        response.prompt_logprobs.add(token_id=first, token=self.service.token_text(first))
        for lp in entries:
            self._add_logprob(response.prompt_logprobs.add(), lp)

    def _add_logprob(self, out: common_pb2.TokenLogprob, lp: common_pb2.TokenLogprob) -> None:
        out.CopyFrom(lp)
        out.token = self.service.token_text(lp.token_id)
        for top in out.top:
            top.token = self.service.token_text(top.token_id)

    def _abort_sample(self, index: int) -> None:
        if len(self.samples) == 1:
            self.leave()  # leaving the only subscription aborts the request at the scheduler
            return
        self.stopped_by_us.append(index)
        self.service.spawn(self.service.abort_sample(self.request_id, index, self.target.stub))

    async def _reattach(self, retry_until: float) -> None:
        """Subscribe again past the tokens already received, or raise."""
        attach = scheduler_pb2.ScheduleRequest()
        attach.CopyFrom(self.schedule)
        attach.attach = True
        attach.skip_tokens.extend(s.received for s in self.samples)
        delay = RETRY_BACKOFF_S[0]
        while True:
            left = retry_until - time.monotonic()
            if left <= 0:
                raise StatusError(grpc.StatusCode.UNAVAILABLE,
                                  f"the scheduler did not come back within --scheduler-retry-timeout "
                                  f"({self.service.retry_timeout_s:g} s)")
            await self._route(attach)
            self.sub = self.target.link.subscribe(attach)
            try:
                first = await asyncio.wait_for(self.sub.read(), left)
            except asyncio.TimeoutError:
                self.leave()
                continue  # the loop head reports the timeout
            except StatusError as exc:
                if exc.code == grpc.StatusCode.NOT_FOUND:
                    # Not the caller's mistake: the restarted scheduler had no durable record of it.
                    raise StatusError(grpc.StatusCode.UNAVAILABLE,
                                      f"the scheduler restarted and lost request {self.request_id!r} "
                                      f"(is it running without Redis?): {exc.details}") from None
                if exc.code not in RETRYABLE:
                    raise
                first = None
            if first is None or isinstance(first, Broken):
                await asyncio.sleep(min(delay, max(0.0, retry_until - time.monotonic())))
                delay = min(delay * 2, RETRY_BACKOFF_S[1])
                continue
            if not first.accepted:
                raise StatusError(grpc.StatusCode.INTERNAL,
                                  "the scheduler's re-attached stream did not start with accepted")
            log.info("request %s re-attached", self.request_id)
            for index in self.stopped_by_us:  # a restarted scheduler does not know about them
                self.service.spawn(self.service.abort_sample(self.request_id, index, self.target.stub))
            return

    # -- a resumable stream whose caller vanished -----------------------------------------------
    def detach(self) -> None:
        """Keep the request running for its resume grace (a client may resume it through
        another gateway), then leave."""
        if self.detached or self.sub is None or self.sub.closed or (
                self.samples and all(s.finished for s in self.samples)):
            return
        self.detached = True
        log.info("request %s: its caller went away; it keeps running %.0f s for a resume", self.request_id,
                 self.resume_grace_s)
        self.service.spawn(self._linger())

    async def _linger(self) -> None:
        deadline = time.monotonic() + self.resume_grace_s
        finished = [s.finished for s in self.samples]
        try:
            while not (finished and all(finished)):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    delta = await asyncio.wait_for(self.sub.read(), left)
                except (asyncio.TimeoutError, StatusError):
                    break
                if isinstance(delta, Broken):
                    break
                if not delta.accepted and delta.finish_reason and delta.index < len(finished):
                    finished[delta.index] = True
        finally:
            self.leave()  # still orphaned: the scheduler aborts it; resumed: the resumer holds it

"""Who hears a request's tokens: subscriptions, the outboxes of the streams they ride on, and the
per-subscription filter that turns deliveries into TokenDelta messages.

A stream is either one request's `Generate` call or a tokenizer's `Stream`, which carries every
request that tokenizer sends (vLLM's one EngineCoreOutputs per client per step). Either way the
stream owns one `Outbox`; each subscription on it pushes there.

Threads: the record writer (after the step's records are durable) and the step loop (replays,
errors) post to outboxes; `Outbox.post` hands a whole batch to the stream's event loop in one
call_soon_threadsafe, so a step costs one wake-up per stream, not one per request. Everything
else here runs on that event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pagedserve.common import wire
from pagedserve.common.grpc_util import StatusError
from pagedserve.common.messages import SampledToken
from pagedserve.v1 import scheduler_pb2


@dataclass(slots=True)
class Delivery:
    """New tokens of one sample: token_ids start at output position `start`."""
    index: int
    start: int
    token_ids: list[int]
    logprobs: list[SampledToken] | None = None
    finish_reason: str = ""
    timings: dict | None = None  # on a sample's last delivery
    num_cached_tokens: int = 0
    # The request's, with sample 0's first token (start 0), when asked: once per request.
    prompt_logprobs: list[SampledToken] | None = None
    embedding: bytes | None = None  # an embedding request's vector, with its finish


class Outbox:
    """One stream's inbox of (subscription, item) pairs; item is (is_replay, [Delivery]) or a
    StatusError that ends that subscription."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[list[tuple[Subscription, object]]] = asyncio.Queue()

    def post(self, items: list[tuple[Subscription, object]]) -> None:
        """From any thread: one hand-over for the whole batch."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, items)
        except RuntimeError:
            pass  # the stream's loop is gone: nobody is listening

    def post_here(self, items: list[tuple[Subscription, object]]) -> None:
        """From the stream's own event loop."""
        self.queue.put_nowait(items)

    async def next_batch(self) -> list[tuple[Subscription, object]]:
        """Everything posted so far (at least one batch): a step's deliveries leave together."""
        items = list(await self.queue.get())
        while not self.queue.empty():
            items.extend(self.queue.get_nowait())
        return items


@dataclass(eq=False, slots=True)
class Subscription:
    """One stream's interest in one request. `replayed` False: deliveries are ignored until the
    replay of the tokens so far has arrived (a second stream attaching to a live request)."""
    group_id: str
    outbox: Outbox
    replayed: bool
    tag: int = 0  # the tokenizer's id for it on a Stream (echoed on every message)

    def push(self, item) -> None:
        self.outbox.post([(self, item)])


@dataclass(slots=True)
class DeltaFilter:
    """The TokenDelta messages of one subscription: replays and live deliveries line up by output
    position (skip_tokens on a re-attach), so no token is sent twice and none is lost. The
    request's prompt logprobs go to a subscriber that asks for them (its schedule's params: a
    gateway's resume does not) and has not had sample 0's first delivery, which carried them."""
    request_id: str
    n: int
    tag: int = 0
    sent: list[int] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    replayed: bool = False
    prompt_logprobs: bool = True

    @classmethod
    def for_request(cls, request_id: str, n: int, skip_tokens, replayed: bool, tag: int = 0,
                    prompt_logprobs: bool = True) -> DeltaFilter:
        sent = list(skip_tokens)[:n] + [0] * max(0, n - len(skip_tokens))
        return cls(request_id, n, tag, sent, [False] * n, replayed, prompt_logprobs)

    @property
    def done(self) -> bool:
        return all(self.finished)

    def deltas(self, is_replay: bool, deliveries: list[Delivery]) -> list[scheduler_pb2.TokenDelta]:
        self.replayed |= is_replay
        if not self.replayed:
            return []
        out = []
        for delivery in deliveries:
            index = delivery.index
            if index >= self.n or self.finished[index]:
                continue
            skip = max(0, self.sent[index] - delivery.start)
            tokens = delivery.token_ids[skip:]
            logprobs = delivery.logprobs[skip:] if delivery.logprobs else None
            # The prompt's logprobs ride with sample 0's first token: past it, this subscriber has them.
            prompt = delivery.prompt_logprobs if self.prompt_logprobs and self.sent[index] <= delivery.start \
                else None
            self.sent[index] += len(tokens)
            if tokens or delivery.finish_reason:
                out.append(delta_message(self.request_id, delivery, tokens, logprobs, self.tag, prompt))
            self.finished[index] = bool(delivery.finish_reason)
        return out


def delta_message(request_id: str, delivery: Delivery, tokens: list[int], logprobs,
                  tag: int = 0, prompt_logprobs=None) -> scheduler_pb2.TokenDelta:
    msg = scheduler_pb2.TokenDelta(request_id=request_id, index=delivery.index, token_ids=tokens,
                                   finish_reason=delivery.finish_reason,
                                   num_cached_tokens=delivery.num_cached_tokens, tag=tag)
    if logprobs:
        for token in logprobs:
            wire.token_to_proto(token, msg.logprobs.add())
    for token in prompt_logprobs or ():
        wire.token_to_proto(token, msg.prompt_logprobs.add())
    if delivery.timings:
        wire.timings_from_dict(delivery.timings, msg.timings)
    if delivery.embedding:
        msg.embedding = delivery.embedding
    return msg


def accepted_message(group, tag: int = 0) -> scheduler_pb2.TokenDelta:
    """The first message of a subscription: the request's id, sample count and prompt length."""
    msg = scheduler_pb2.TokenDelta(request_id=group.group_id, accepted=True, n=group.n,
                                   num_prompt_tokens=len(group.prompt_token_ids), tag=tag)
    wire.timings_from_dict(group.timings, msg.timings)
    return msg


def error_message(tag: int, request_id: str, error: StatusError) -> scheduler_pb2.SubscriptionError:
    return scheduler_pb2.SubscriptionError(tag=tag, request_id=request_id, code=error.code.value[0],
                                           message=error.details)

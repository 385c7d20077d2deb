"""A fake worker group for driving the scheduler service without a model: the scheduler's
WorkerGroup interface over the model runner's own request bookkeeping (RequestStates), sampling a
known function of the token ids, so every output is known in advance (prompt logprobs too: position
p's is -p)."""

from __future__ import annotations

import time
import uuid
from collections import deque

from pagedserve.common.messages import ModelRunnerOutput, PromptLogprobs, SampledToken, SchedulerOutput
from pagedserve.common.store import open_store
from pagedserve.v1 import worker_pb2
from pagedserve.worker.request_states import RequestStates

VOCAB = 1000


def next_token(token_ids: list[int]) -> int:
    return (sum(token_ids) * 31 + len(token_ids)) % VOCAB


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens:
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def prompt_logprobs(state, n: int) -> PromptLogprobs:
    """The prompt positions this chunk of n tokens predicts, each with "logprob" -position."""
    c = state.num_computed_tokens
    span = range(c + 1, min(c + n, state.num_prompt_tokens - 1) + 1)
    return PromptLogprobs(c + 1, [SampledToken(state.token_ids[p], -float(p)) for p in span])


class FakeWorkerGroup:
    """The WorkerGroup interface of the scheduler over RequestStates (greedy: n samples all get
    expected()), with an optional pause per step so that tests can act between steps."""

    addresses = ["fake:0"]

    def __init__(self, num_blocks: int = 256, step_delay_s: float = 0.0, whole_images: bool = False) -> None:
        """whole_images: it describes a model that computes each image whole (WorkerInfo.whole_images)."""
        self.num_blocks, self.step_delay_s, self.whole_images = num_blocks, step_delay_s, whole_images
        self.requests = RequestStates()
        self.num_steps = 0
        self.sent: deque[ModelRunnerOutput] = deque()  # outputs of the steps sent, not yet received
        # ("send" | "receive", step id, whether the step has prompt tokens), in order.
        self.events: list[tuple[str, int, bool]] = []

    def connect(self, timeout_s: float) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(model="fake", device="cpu", max_model_len=512, vocab_size=VOCAB,
                                     whole_images=self.whole_images)

    def init_session(self, profile: worker_pb2.ProfileRequest) -> worker_pb2.ProfileResponse:
        self.requests = RequestStates()
        self.sent.clear()
        return worker_pb2.ProfileResponse(num_gpu_blocks=self.num_blocks, bytes_per_block=1)

    def step(self, out: SchedulerOutput, wants_logprobs) -> tuple[ModelRunnerOutput, float]:
        self.send(out)
        return self.receive(out, wants_logprobs)

    def send(self, out: SchedulerOutput) -> None:
        """Runs the step at once (a worker runs its steps in the order sent); receive() hands its
        output over after the step delay."""
        self.events.append(("send", out.step_id, any(n > 1 for n in out.num_scheduled_tokens.values())))
        self.sent.append(self._run(out))

    def receive(self, out: SchedulerOutput, wants_logprobs) -> tuple[ModelRunnerOutput, float]:
        time.sleep(self.step_delay_s)
        result = self.sent.popleft()
        self.events.append(("receive", out.step_id, False))
        assert result.step_id == out.step_id, f"step {out.step_id} received, {result.step_id} was due"
        return result, 0.0

    def _run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        self.requests.apply(out)
        scheduled = [(self.requests.state(r), n) for r, n in out.num_scheduled_tokens.items()]
        prompt = {s.req_id: prompt_logprobs(s, n) for s, n in scheduled if s.params.prompt_logprobs is not None}
        self.requests.advance(scheduled)
        # Greedy: every sample draws the same token (at the fork step, one per sample).
        sampled = {s.req_id: [next_token(s.token_ids)] * (1 + len(s.child_req_ids)) for s, _ in scheduled
                   if s.num_computed_tokens == len(s.token_ids)}
        self.requests.commit(sampled)
        return ModelRunnerOutput(out.step_id, {r: [SampledToken(t) for t in ts] for r, ts in sampled.items()},
                                 prompt_logprobs={r: p for r, p in prompt.items() if p.tokens},
                                 grammars_ready=[g.key() for g in out.grammars])  # compiles nothing

    def close_streams(self) -> None:
        self.sent.clear()

    def close(self) -> None:
        pass


def started_service(step_delay_s: float, max_num_batched_tokens: int, redis_url: str = "redis://127.0.0.1:6379/0",
                    whole_images: bool = False):
    """A started SchedulerService over a FakeWorkerGroup and the real Redis under a fresh key prefix
    (the caller stops it)."""
    from pagedserve.scheduler.service import SchedulerService, ServiceConfig

    store = open_store(redis_url, f"pstest-{uuid.uuid4().hex[:8]}:", 60, 60)
    service = SchedulerService(ServiceConfig(max_num_seqs=64, max_num_batched_tokens=max_num_batched_tokens,
                                             async_scheduling=True),
                               FakeWorkerGroup(step_delay_s=step_delay_s, whole_images=whole_images), store)
    service.start()
    return service

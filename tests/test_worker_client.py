"""The scheduler's worker client over real gRPC sockets: a step's answer is read on the step
loop's own thread; a rank that never answers is cancelled by the watchdog within the step timeout
(and says so); a rank that goes away fails the step at once, naming no timeout."""

import threading
import time
from concurrent import futures

import grpc
import pytest

from pagedserve.common.grpc_util import free_port
from pagedserve.common.messages import SchedulerOutput
from pagedserve.scheduler.worker_client import WorkerError, WorkerGroup, _StepStream
from pagedserve.v1 import worker_pb2, worker_pb2_grpc


class StepOnly(worker_pb2_grpc.WorkerServicer):
    """Answers each step with an empty result, or holds it until the stream is cancelled."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.cancelled = threading.Event()

    def Step(self, request_iterator, context):
        context.add_callback(self.cancelled.set)
        for request in request_iterator:
            if not self.answer:
                self.cancelled.wait(30)
                return
            yield worker_pb2.StepResult(step_id=request.step_id, worker_time_s=0.001)


@pytest.fixture
def rank():
    def start(answer: bool):
        servicer = StepOnly(answer)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        address = f"127.0.0.1:{free_port()}"
        server.add_insecure_port(address)
        server.start()
        started.append(server)
        return address, servicer, server

    started = []
    yield start
    for server in started:
        server.stop(0)


def group_on(address: str, timeout_s: float | None) -> WorkerGroup:
    group = WorkerGroup([address], step_timeout_s=timeout_s)
    group.session_id = "s"
    group.streams = [_StepStream(stub) for stub in group.stubs]  # what init_session opens
    return group


def empty_step(step_id: int) -> SchedulerOutput:
    return SchedulerOutput(step_id=step_id, new_requests=[], cached_requests=[], num_scheduled_tokens={})


def test_steps_are_answered_in_order(rank):
    address, _, _ = rank(answer=True)
    group = group_on(address, timeout_s=5.0)
    try:
        for step_id in range(1, 6):
            result, overhead = group.step(empty_step(step_id), set())
            assert result.step_id == step_id and overhead >= 0.0
        assert group.watchdog.deadline is None and not group.watchdog.fired
    finally:
        group.close()


def test_a_rank_that_never_answers_is_cancelled_at_the_step_timeout(rank):
    address, servicer, _ = rank(answer=False)
    group = group_on(address, timeout_s=0.4)
    started = time.monotonic()
    try:
        with pytest.raises(WorkerError, match=r"during step 7: no step result within 0.4 s \(--step-timeout\)"):
            group.step(empty_step(7), set())
        assert 0.4 <= time.monotonic() - started < 3.0
        assert servicer.cancelled.wait(20)  # the worker side sees the stream end
        with pytest.raises(WorkerError):  # the stream stays broken until a new session opens one
            group.step(empty_step(8), set())
    finally:
        group.close()


def test_a_rank_that_goes_away_fails_the_step_without_waiting_for_the_timeout(rank):
    address, _, server = rank(answer=True)
    group = group_on(address, timeout_s=30.0)
    try:
        group.step(empty_step(1), set())
        # Wait until the server is down: stop() returns at once, and a step sent before its
        # handler saw the cancellation could still be answered (1 run in ~15 failed so).
        assert server.stop(0).wait(5)
        started = time.monotonic()
        with pytest.raises(WorkerError) as failure:
            group.step(empty_step(2), set())
        assert time.monotonic() - started < 10.0
        assert "--step-timeout" not in str(failure.value)
    finally:
        group.close()


@pytest.mark.parametrize("behind", [False, True], ids=["cpu", "device-behind"])
def test_steps_sent_ahead_run_on_the_workers_own_samples(tiny_llama, monkeypatch, behind):
    """Async scheduling against the real worker service (tiny Llama, float32), over the gRPC Step
    stream and over the local step link: each step is scheduled and sent before the last one's
    results are in, so its decodes read tokens only the worker has yet. The outputs equal those of
    steps sent one at a time over gRPC, n > 1 forks, a stop token (the step after it ran for
    nothing) and a length stop included.

    device-behind: a stand-in for a GPU, where a begun step is done only some time after begin
    returns (BegunStep.ready, 30 ms late): the local link and the gRPC stream then begin the step sent
    ahead before they answer the one before, and that step's rows read their tokens from the sampled
    ids on the device (worker/step_overlap.py)."""
    from pagedserve.common.sampling_params import SamplingParams
    from pagedserve.scheduler.core.request import Request
    from pagedserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
    from pagedserve.scheduler.worker_client import _LocalStepStream
    from pagedserve.worker.server import WorkerService, WorkerServicer, open_step_socket

    service = WorkerService(str(tiny_llama), device="cpu", dtype="float32", quantization="none")
    service.load()
    if behind:
        from pagedserve.worker.server import BegunStep
        monkeypatch.setattr(BegunStep, "ready", lambda begun: time.perf_counter() - begun.received > 0.03)
    step_socket = open_step_socket(service)
    ready = threading.Event()
    ready.set()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(service, ready), server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    groups = {transport: WorkerGroup([address], step_timeout_s=60.0, transport=transport)
              for transport in ("grpc", "auto")}

    def generate(transport: str, ahead: bool, stop_ids: list[int]) -> dict[str, list[int]]:
        group = groups[transport]
        group.infos = [worker_pb2_grpc.WorkerStub(group.channels[0]).Describe(worker_pb2.DescribeRequest())]
        sizes = group.init_session(worker_pb2.ProfileRequest(block_size=4, kv_cache_memory=str(1 << 20),
                                                             max_num_batched_tokens=16))
        local = transport == "auto"
        assert [isinstance(s, _LocalStepStream) for s in group.streams] == [local]
        sched = Scheduler(SchedulerConfig(num_gpu_blocks=sizes.num_gpu_blocks, block_size=4, max_num_batched_tokens=16,
                                          max_model_len=128))
        prompts = {"a": [5, 6, 7, 8, 9, 10, 11], "b": list(range(20, 43)), "c": [3, 4]}
        for i, (rid, prompt) in enumerate(prompts.items()):
            params = SamplingParams(n=2 if rid == "c" else 1, temperature=0.0, ignore_eos=True, max_tokens=12,
                                    stop_token_ids=stop_ids if rid == "a" else [])
            sched.add_request(Request(rid, list(prompt), len(prompt), params, arrival_time=float(i)))
        outputs, inflight = {}, []
        while sched.has_unfinished() or inflight:
            if not inflight:
                inflight.append(sched.schedule())
                group.send(inflight[-1])
            if ahead and len(inflight) == 1 and not sched.needs_sync:
                step = sched.schedule(ahead=True)
                if step is not None:
                    inflight.append(step)
                    group.send(step)
            step = inflight.pop(0)
            result, _ = group.receive(step, set())
            for update in sched.update(step, result):
                if update.finished:
                    outputs[update.request.request_id] = update.request.output_token_ids
        return outputs

    try:
        assert step_socket is not None and service.describe().step_socket == step_socket.path
        plain = generate("grpc", False, [])
        stop = plain["a"][4]
        want = dict(plain, a=plain["a"][:plain["a"].index(stop) + 1])
        for transport in ("grpc", "auto"):
            held = service.runner.held_rows
            assert generate(transport, False, [stop]) == want
            assert generate(transport, True, [stop]) == want
            assert generate(transport, True, []) == plain
            assert (service.runner.held_rows > held) == behind, transport
        assert set(plain) == {"a", "b", "c", "c#1"} and all(len(t) == 12 for t in plain.values())
    finally:
        for group in groups.values():
            group.close()
        step_socket.close()
        server.stop(0)
        service.torch_thread.shutdown()

"""The scheduler's Stream RPC (a tokenizer's one stream for all its requests), through the real
servicer over a gRPC socket and over its local socket (common/local_calls.py), with the fake worker
group and the real Redis store: one message per step carries every request's deltas; a refused
subscription fails alone; leaving aborts."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fake_workers import expected, started_service

from pagedserve.common.grpc_util import free_port
from pagedserve.common.local_call_server import LocalCallServer, Method
from pagedserve.common.local_calls import LocalOrGrpcCall, LocalSocketPath
from pagedserve.scheduler.server import SchedulerServicer
from pagedserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc



def schedule(request_id: str, prompt: list[int], max_tokens: int, tag: int, **extra) -> scheduler_pb2.StreamCommand:
    return scheduler_pb2.StreamCommand(schedule=scheduler_pb2.ScheduleRequest(
        request_id=request_id, prompt_token_ids=prompt, tag=tag,
        params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), **extra))


@pytest.fixture
def scheduler():
    service = started_service(0.005, 512)
    yield service
    service.stop()


@pytest.fixture(params=["grpc", "local"])
def transport(request):
    return request.param


class Served:
    """The servicer on a gRPC port and its local socket; stop() stops both."""

    def __init__(self, server, local: LocalCallServer) -> None:
        self.server, self.local = server, local

    async def stop(self, grace) -> None:
        await self.local.stop()
        await self.server.stop(grace)


class StreamStub:
    """Stream over the local socket (transport "local", as the tokenizer's link does) or gRPC."""

    def __init__(self, stub, transport: str) -> None:
        self.stub, self.transport = stub, transport

    def Stream(self, commands):  # noqa: N802 - the stub's name
        if self.transport == "grpc":
            return self.stub.Stream(commands)
        where = LocalSocketPath(lambda: self.stub.GetLocalSocket(common_pb2.LocalSocketRequest()))
        return LocalOrGrpcCall(where, "Stream", scheduler_pb2.StepDeltas,
                               lambda: pytest.fail("the local socket was not used"), requests=commands)


async def serve(service, transport: str = "grpc"):
    server = grpc.aio.server()
    servicer = SchedulerServicer(service)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    local = LocalCallServer({"Stream": Method(servicer.Stream, scheduler_pb2.StreamCommand, True)}, "scheduler")
    servicer.local_socket = await local.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return Served(server, local), channel, StreamStub(scheduler_pb2_grpc.SchedulerStub(channel), transport)


def test_one_message_per_step_carries_every_request(scheduler, transport):
    prompts = {tag: [tag] * (3 + tag) for tag in range(1, 25)}

    async def main():
        server, channel, stub = await serve(scheduler, transport)
        commands: asyncio.Queue = asyncio.Queue()
        for tag, prompt in prompts.items():
            commands.put_nowait(schedule(f"s{tag}", prompt, 16, tag))

        async def command_iter():
            while True:
                yield await commands.get()

        call = stub.Stream(command_iter())
        tokens = {tag: [] for tag in prompts}
        finished, accepted, messages = set(), set(), 0
        steps_before = scheduler.workers.num_steps
        async for message in call:
            messages += any(not d.accepted for d in message.deltas)  # acceptances may come apart
            assert not message.errors
            for delta in message.deltas:
                if delta.accepted:
                    accepted.add(delta.tag)
                    assert delta.request_id == f"s{delta.tag}" and delta.n == 1
                    continue
                tokens[delta.tag].extend(delta.token_ids)
                if delta.finish_reason:
                    finished.add(delta.tag)
            if len(finished) == len(prompts):
                break
        call.cancel()
        steps = scheduler.workers.num_steps - steps_before
        await channel.close()
        await server.stop(None)
        return tokens, accepted, messages, steps

    tokens, accepted, messages, steps = asyncio.run(main())
    assert accepted == set(prompts)
    assert tokens == {tag: expected(prompt, 16) for tag, prompt in prompts.items()}
    # 24 requests x 16 tokens in at most one message per step, not 384.
    assert messages <= steps + 1, (messages, steps)


def test_refused_subscription_fails_alone_and_leave_aborts(scheduler, transport):
    scheduler.workers.step_delay_s = 0.02

    async def main():
        server, channel, stub = await serve(scheduler, transport)
        commands: asyncio.Queue = asyncio.Queue()

        async def command_iter():
            while True:
                yield await commands.get()

        call = stub.Stream(command_iter())
        commands.put_nowait(schedule("long", [1, 2, 3], 500, tag=1))
        commands.put_nowait(schedule("too-big", [5] * 10, 10_000, tag=2))   # past max_model_len 512
        commands.put_nowait(schedule("unknown", [5], 4, tag=3, attach=True))  # nothing to attach to
        commands.put_nowait(schedule("dup", [7, 7], 4, tag=1))  # tag 1 is taken
        errors, got = {}, 0
        async for message in call:
            for error in message.errors:
                errors[error.tag, error.request_id] = (grpc.StatusCode.INVALID_ARGUMENT.value[0] == error.code,
                                                       grpc.StatusCode.NOT_FOUND.value[0] == error.code, error.message)
            got += sum(len(d.token_ids) for d in message.deltas if d.tag == 1)
            if len(errors) == 3 and got >= 5:
                break
        commands.put_nowait(scheduler_pb2.StreamCommand(leave=1))
        for _ in range(300):  # the blocks free on the step loop, the record is written after
            stats = scheduler.stats()
            if stats.num_running == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks and \
                    scheduler.store.load("long").finish_reasons == ["abort"]:
                break
            await asyncio.sleep(0.02)
        call.cancel()
        await channel.close()
        await server.stop(None)
        return errors, stats

    errors, stats = asyncio.run(main())
    assert errors[2, "too-big"][0] and "maximum context length" in errors[2, "too-big"][2]
    assert errors[3, "unknown"][1]
    assert errors[1, "dup"][0] and "tag 1" in errors[1, "dup"][2]
    # The long request kept going through the refusals; leaving aborted it and freed its blocks.
    assert stats.num_running == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert scheduler.store.load("long").finish_reasons == ["abort"]


def test_colliding_ids_on_a_stream_are_refused_and_the_others_finish(scheduler, transport):
    """Issue 13: on the gRPC Stream, the sample-id collision (`X#1`, then `X` with n=2) and two
    schedules of one new id with different prompts sent together: each refusal is an
    ALREADY_EXISTS error for that subscription alone; everything accepted finishes exactly."""

    async def main():
        server, channel, stub = await serve(scheduler, transport)
        commands = [schedule("bystander", [3, 1, 4], 24, tag=1), schedule("X#1", [2, 7], 12, tag=2),
                    schedule("X", [8, 8], 12, tag=3), schedule("dup", [5, 5], 12, tag=4),
                    schedule("dup", [6, 6], 12, tag=5)]
        commands[2].schedule.params.n = 2

        async def command_iter():
            for command in commands:
                yield command
            await asyncio.Event().wait()  # keep the stream open

        call = stub.Stream(command_iter())
        tokens, finished, errors = {}, set(), {}
        async for message in call:
            for error in message.errors:
                errors[error.tag] = (error.code, error.message)
            for delta in message.deltas:
                tokens.setdefault(delta.tag, []).extend(delta.token_ids)
                if delta.finish_reason:
                    finished.add(delta.tag)
            if finished | set(errors) == {1, 2, 3, 4, 5}:
                break
        call.cancel()
        await channel.close()
        await server.stop(None)
        return tokens, finished, errors

    tokens, finished, errors = asyncio.run(main())
    exists = grpc.StatusCode.ALREADY_EXISTS.value[0]
    assert set(errors) == {3, 5} and {code for code, _ in errors.values()} == {exists}
    assert "'X#1'" in errors[3][1] and "'dup'" in errors[5][1]
    assert tokens[1] == expected([3, 1, 4], 24) and tokens[2] == expected([2, 7], 12)
    assert tokens[4] == expected([5, 5], 12)

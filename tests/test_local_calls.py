"""Local calls (pagedserve/common/local_calls.py): one servicer served over gRPC and over its local
Unix socket answers alike, message for message and status for status; a client without a reachable
socket falls back to gRPC; cancellation, deadlines, malformed input and a vanished server behave
as gRPC's do. Real sockets and a real grpc.aio server throughout."""

from __future__ import annotations

import asyncio
import os
import stat

import grpc
import pytest

from pagedserve.common.grpc_util import free_port
from pagedserve.common.local_call_server import LocalCallServer, Method
from pagedserve.common.local_calls import LocalOrGrpcCall, LocalSocketPath
from pagedserve.common.step_frames import frame
from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc


class Echo(generate_pb2_grpc.TokenizerServicer):
    """Generate answers request.prompt_token_ids.ids one response each (text = the id), with the
    call's metadata in the first; a request whose model is "abort" / "boom" / "hang" aborts, raises, hangs."""

    def __init__(self) -> None:
        self.local_socket = ""
        self.done: list[bool] = []  # context.cancelled() as each call's done callback saw it
        self.hanging = asyncio.Event()

    async def Generate(self, request, context):
        context.add_done_callback(lambda ctx: self.done.append(ctx.cancelled()))
        meta = ",".join(f"{k}={v}" for k, v in context.invocation_metadata() if k.startswith("x-"))
        if request.model == "abort":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many tokens: 9 > 8")
        if request.model == "boom":
            raise RuntimeError("boom")
        for i, token in enumerate(request.prompt_token_ids.ids):
            yield generate_pb2.GenerateResponse(request_id=meta if i == 0 else "", text=str(token))
        if request.model == "hang":
            self.hanging.set()
            await asyncio.Event().wait()

    async def GetLocalSocket(self, request, context):
        return common_pb2.LocalSocket(path=self.local_socket)


async def start(servicer: Echo):
    server = grpc.aio.server()
    generate_pb2_grpc.add_TokenizerServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    local = LocalCallServer({"Generate": Method(servicer.Generate, generate_pb2.GenerateRequest)}, "test")
    servicer.local_socket = await local.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = generate_pb2_grpc.TokenizerStub(channel)
    return server, local, channel, stub


def call(stub, where: LocalSocketPath, request, metadata=(), timeout=None) -> LocalOrGrpcCall:
    return LocalOrGrpcCall(where, "Generate", generate_pb2.GenerateResponse,
                           lambda: stub.Generate(request, metadata=metadata, timeout=timeout),
                           request=request, metadata=metadata, timeout=timeout)


async def outcome(the_call) -> tuple[list[tuple[str, str]], tuple[grpc.StatusCode, str] | None]:
    got, status = [], None
    try:
        async for response in the_call:
            got.append((response.request_id, response.text))
    except grpc.aio.AioRpcError as exc:
        status = (exc.code(), exc.details())
    return got, status


def request(ids, action="") -> generate_pb2.GenerateRequest:
    msg = generate_pb2.GenerateRequest(model=action)
    msg.prompt_token_ids.ids.extend(ids)
    return msg


def test_local_and_grpc_answer_alike():
    async def main():
        servicer = Echo()
        server, local, channel, stub = await start(servicer)
        local_where = LocalSocketPath(lambda: stub.GetLocalSocket(common_pb2.LocalSocketRequest()))
        grpc_where = LocalSocketPath(None)
        results = {}
        for name, where in (("local", local_where), ("grpc", grpc_where)):
            for case in (request([5, 6, 7]), request(range(300)), request([1], "abort"), request([1, 2], "boom"),
                         request([])):
                c = call(stub, where, case, metadata=(("x-owner", "k1"),))
                results.setdefault(name, []).append(await outcome(c))
                assert c.over_local_socket == (name == "local")
        mode = stat.S_IMODE(os.stat(os.path.dirname(local.path)).st_mode)
        await local.stop()
        gone = os.path.exists(local.path)
        await channel.close()
        await server.stop(None)
        return results, servicer.done, mode, gone

    results, done, mode, gone = asyncio.run(main())
    assert results["local"] == results["grpc"]
    first = results["local"]
    assert first[0] == ([("x-owner=k1", "5"), ("", "6"), ("", "7")], None)
    assert [text for _, text in first[1][0]] == [str(i) for i in range(300)]
    assert first[2] == ([], (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many tokens: 9 > 8"))
    assert first[3][1][0] == grpc.StatusCode.UNKNOWN and "boom" in first[3][1][1]
    assert first[4] == ([], None)
    assert done == [False] * 10  # every call's done callback ran, none cancelled
    assert mode == 0o700 and not gone


def test_cancel_and_deadline_reach_the_handler():
    async def main():
        servicer = Echo()
        server, local, channel, stub = await start(servicer)
        where = LocalSocketPath(lambda: stub.GetLocalSocket(common_pb2.LocalSocketRequest()))
        c = call(stub, where, request([3, 4], "hang"))
        assert (await c.read()).text == "3"
        assert (await c.read()).text == "4"
        await servicer.hanging.wait()
        c.cancel()
        with pytest.raises(asyncio.CancelledError):
            await c.read()
        for _ in range(100):
            if servicer.done:
                break
            await asyncio.sleep(0.01)
        cancelled = list(servicer.done)
        servicer.hanging.clear()
        late = call(stub, where, request([1], "hang"), timeout=0.3)
        deadline = await outcome(late)
        for _ in range(100):
            if len(servicer.done) == 2:
                break
            await asyncio.sleep(0.01)
        await local.stop()
        await channel.close()
        await server.stop(None)
        return cancelled, deadline, servicer.done, late.over_local_socket

    cancelled, deadline, done, local_call = asyncio.run(main())
    assert cancelled == [True]  # the client's cancel cancelled the handler, as gRPC's does
    assert local_call and deadline == ([("", "1")], (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert done == [True, True]


def test_cancel_wakes_a_read_already_waiting():
    # A gateway reading a non-streamed answer cancels the call when its client leaves: the read it is
    # waiting in must end (it waited for ever over the local socket, leaking the request's books).
    async def main():
        servicer = Echo()
        server, local, channel, stub = await start(servicer)
        outcomes = []
        for where in (LocalSocketPath(lambda: stub.GetLocalSocket(common_pb2.LocalSocketRequest())),
                      LocalSocketPath(None)):
            servicer.hanging.clear()
            c = call(stub, where, request([3], "hang"))
            assert (await c.read()).text == "3"
            await servicer.hanging.wait()
            waiting = asyncio.ensure_future(c.read())
            await asyncio.sleep(0.05)
            c.cancel()
            try:
                await asyncio.wait_for(waiting, 5)  # a bound, not a measurement
                outcomes.append("returned")
            except asyncio.CancelledError:
                outcomes.append(("cancelled", c.over_local_socket))
            except asyncio.TimeoutError:
                outcomes.append(("still waiting", c.over_local_socket))
        await local.stop()
        await channel.close()
        await server.stop(None)
        return outcomes

    assert asyncio.run(main()) == [("cancelled", True), ("cancelled", False)]


def test_a_server_that_goes_away_mid_call_is_unavailable():
    async def main():
        servicer = Echo()
        server, local, channel, stub = await start(servicer)
        where = LocalSocketPath(lambda: stub.GetLocalSocket(common_pb2.LocalSocketRequest()))
        c = call(stub, where, request([9], "hang"))
        assert (await c.read()).text == "9"
        await local.stop(grace=0.1)  # the hanging call is cut after the grace
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.read()
        await channel.close()
        await server.stop(None)
        return info.value.code(), c.over_local_socket

    code, over_local = asyncio.run(main())
    assert over_local and code == grpc.StatusCode.UNAVAILABLE


def test_fallback_to_grpc_when_the_socket_is_missing_or_unknown():
    async def main():
        servicer = Echo()
        server, local, channel, stub = await start(servicer)
        asked = []

        async def ask_stale():
            asked.append(1)
            return common_pb2.LocalSocket(path="/nonexistent/pagedserve-gone/calls.sock" if len(asked) == 1
                                          else servicer.local_socket)

        async def ask_unimplemented():
            return await stub.Tokenize(generate_pb2.TokenizeRequest(), timeout=1)  # the servicer's base: UNIMPLEMENTED

        where = LocalSocketPath(ask_stale)
        stale = call(stub, where, request([1, 2]))
        first = (await outcome(stale), stale.over_local_socket)
        again = call(stub, where, request([1, 2]))  # the stale path was forgotten: asked again, now local
        second = (await outcome(again), again.over_local_socket)
        old = call(stub, LocalSocketPath(ask_unimplemented), request([4]))
        third = (await outcome(old), old.over_local_socket)
        await local.stop()
        await channel.close()
        await server.stop(None)
        return first, second, third, len(asked)

    first, second, third, asked = asyncio.run(main())
    assert first == (([("", "1"), ("", "2")], None), False)
    assert second == (([("", "1"), ("", "2")], None), True)
    assert third == (([("", "4")], None), False)
    assert asked == 2


def test_malformed_frames_fail_that_call_alone():
    async def main():
        servicer = Echo()
        server, local, channel, stub = await start(servicer)

        async def raw(*frames: bytes) -> bytes:
            reader, writer = await asyncio.open_unix_connection(local.path)
            for f in frames:
                writer.write(frame(f))
            data = await reader.read()
            writer.close()
            return data

        bad_message = await raw(b'{"method": "Generate"}', b"M\xff\xff\xff")
        bad_method = await raw(b'{"method": "Nope"}')
        bad_head = await raw(b"not json")
        good = await outcome(call(stub, LocalSocketPath(lambda: stub.GetLocalSocket(common_pb2.LocalSocketRequest())),
                                  request([8])))
        await local.stop()
        await channel.close()
        await server.stop(None)
        return bad_message, bad_method, bad_head, good

    bad_message, bad_method, bad_head, good = asyncio.run(main())
    assert b"SINVALID_ARGUMENT\na malformed request message" in bad_message
    assert b"SUNIMPLEMENTED\nnot a call this socket serves" in bad_method and b"Nope" in bad_method
    assert b"SUNIMPLEMENTED" in bad_head
    assert good == ([("", "8")], None)  # the server went on serving

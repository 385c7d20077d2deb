"""The tokenizer service's Generate against a scripted scheduler: a real gRPC server on a free port
whose replies each test scripts, for what the real scheduler does not do on demand (break a stream
at a chosen token, lose a request, stay away past the retry timeout). The same paths against the
real services: tests/test_services_e2e.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedserve.common.grpc_util import free_port
from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc


# -- Generate against a fake scheduler ------------------------------------------------------------


class ScriptAbort(Exception):
    """A script's context.abort() on a Stream subscription."""

    def __init__(self, code, details):
        super().__init__(details)
        self.code, self.details = code, details


class SubscriptionContext:
    """What a script sees as its context on the tokenizer's multiplexed Stream: an abort before
    the script has accepted is a refusal of that subscription (as the real scheduler's submit
    refuses), after it the whole stream fails (as a scheduler going away)."""

    async def abort(self, code, details):
        raise ScriptAbort(code, details)


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Each subscription (a Generate call, or a schedule command on the tokenizer's Stream) runs
    the next script: an async generator fn(request, context, fake)."""

    def __init__(self, scripts):
        self.scripts = list(scripts)
        self.requests: list[scheduler_pb2.ScheduleRequest] = []
        self.aborts: list[tuple[str, int | None]] = []
        self.cancelled = asyncio.Event()
        self.ready = True

    async def Generate(self, request, context):
        self.requests.append(request)
        script = self.scripts.pop(0)
        try:
            async for msg in script(request, context, self):
                yield msg
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def Stream(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()
        tasks: dict[int, asyncio.Task] = {}

        async def run(schedule):
            self.requests.append(schedule)
            script = self.scripts.pop(0)
            started = False
            try:
                async for msg in script(schedule, SubscriptionContext(), self):
                    started = True
                    msg.tag = schedule.tag
                    if isinstance(msg, scheduler_pb2.SubscriptionError):  # the request failed, alone
                        await out.put(scheduler_pb2.StepDeltas(errors=[msg]))
                        return
                    await out.put(scheduler_pb2.StepDeltas(deltas=[msg]))
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            except ScriptAbort as exc:
                if started:
                    await out.put(exc)
                else:
                    await out.put(scheduler_pb2.StepDeltas(errors=[scheduler_pb2.SubscriptionError(
                        tag=schedule.tag, request_id=schedule.request_id, code=exc.code.value[0],
                        message=exc.details)]))

        async def read_commands():
            async for command in request_iterator:
                if command.WhichOneof("command") == "schedule":
                    tasks[command.schedule.tag] = asyncio.ensure_future(run(command.schedule))
                elif command.WhichOneof("command") == "leave" and command.leave in tasks:
                    tasks.pop(command.leave).cancel()

        reader = asyncio.ensure_future(read_commands())
        try:
            while True:
                item = await out.get()
                if isinstance(item, ScriptAbort):
                    await context.abort(item.code, item.details)
                yield item
        finally:
            reader.cancel()
            for task in tasks.values():
                task.cancel()

    async def Abort(self, request, context):
        self.aborts.append((request.request_id, request.index if request.HasField("index") else None))
        return scheduler_pb2.AbortResponse(found=True)

    async def GetModelInfo(self, request, context):
        return generate_pb2.ModelInfo(model="x", max_model_len=8192, ready=self.ready)


def accepted(request, n=1, prompt=None):
    return scheduler_pb2.TokenDelta(request_id=request.request_id or "sched-id", accepted=True, n=n,
                                    num_prompt_tokens=prompt or len(request.prompt_token_ids), num_cached_tokens=2,
                                    timings=common_pb2.Timings(scheduler_received=1.0))


def streamer(token_ids, n=1, finish="length", fail_after=None, pause=0.0, logprobs=False):
    """A script sending token_ids one per message to each of n samples, then finish."""
    async def script(request, context, fake):
        yield accepted(request, n)
        for i, tid in enumerate(token_ids):
            if fail_after is not None and i == fail_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler shutting down")
            for index in range(n):
                if request.attach and i < request.skip_tokens[index]:
                    continue
                lp = [common_pb2.TokenLogprob(token_id=tid, logprob=-0.5,
                                              top=[common_pb2.TopLogprob(token_id=tid, logprob=-0.5)])]
                yield scheduler_pb2.TokenDelta(request_id=request.request_id, index=index, token_ids=[tid],
                                               logprobs=lp if logprobs else [])
            await asyncio.sleep(pause)
        for index in range(n):
            yield scheduler_pb2.TokenDelta(request_id=request.request_id, index=index, finish_reason=finish,
                                           timings=common_pb2.Timings(finished=2.0))
    return script


async def start_stack(tokenizer, scripts, scheduler=True, retry_timeout=5.0, sampling_defaults=None, images=None):
    from pagedserve.tokenizer.server import TokenizerServicer
    from pagedserve.tokenizer.service import TokenizerService
    sched_port = free_port()
    fake = FakeScheduler(scripts)
    sched_server = None
    if scheduler:
        sched_server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, sched_server)
        sched_server.add_insecure_port(f"127.0.0.1:{sched_port}")
        await sched_server.start()
    service = TokenizerService(tokenizer, "SmolLM2-135M-Instruct", f"127.0.0.1:{sched_port}", retry_timeout,
                               sampling_defaults=sampling_defaults, images=images)
    server = grpc.aio.server()
    generate_pb2_grpc.add_TokenizerServicer_to_server(TokenizerServicer(service), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")

    async def stop():
        await channel.close()
        await server.stop(None)
        if sched_server is not None:
            await sched_server.stop(None)
        await service.close()
    return generate_pb2_grpc.TokenizerStub(channel), fake, sched_server, sched_port, stop


async def collect(stub, request, timeout=20):
    return [r async for r in stub.Generate(request, timeout=timeout)]


def text_of(responses, index=0):
    return "".join(r.text for r in responses if r.index == index and not r.accepted)


def ids_of(responses, index=0):
    return [t for r in responses if r.index == index and not r.accepted for t in r.token_ids]


@pytest.mark.slow
def test_generate_streams_text_usage_and_logprobs(tokenizer):
    out = tokenizer.encode(" Paris is 🎉 nice")

    async def main():
        stub, fake, _, _, stop = await start_stack(tokenizer, [streamer(out, logprobs=True)])
        try:
            req = generate_pb2.GenerateRequest(prompt="The capital of France is", request_id="r1", echo=True,
                                               skip_special_tokens=True,
                                               timings=common_pb2.Timings(gateway_received=0.5))
            res = await collect(stub, req)
            assert res[0].accepted and res[0].request_id == "r1" and res[0].prompt_text == req.prompt
            assert res[0].usage.prompt_tokens == len(tokenizer.encode(req.prompt))
            assert fake.requests[0].prompt_token_ids == tokenizer.encode(req.prompt)
            assert fake.requests[0].timings.tokenizer_received > 0 and fake.requests[0].timings.tokenized > 0
            assert text_of(res) == " Paris is 🎉 nice" and ids_of(res) == out
            assert all(r.text or r.token_ids or r.finish_reason for r in res[1:])
            assert all(len(r.logprobs) == len(r.token_ids) for r in res[1:])
            assert res[1].logprobs[0].token == " Paris" and res[1].logprobs[0].top[0].token == " Paris"
            last = res[-1]
            assert last.finish_reason == "length" and last.usage.completion_tokens == len(out)
            assert last.usage.cached_tokens == 2
            t = last.timings
            assert t.gateway_received == 0.5 and t.scheduler_received == 1.0 and t.finished == 2.0
            assert t.tokenizer_received > 0 and t.detokenized >= t.tokenized
        finally:
            await stop()
    asyncio.run(main())


@pytest.mark.slow
def test_stop_string_cancels_single_sample(tokenizer):
    out = tokenizer.encode(" one two. three four five six")

    async def main():
        stub, fake, _, _, stop = await start_stack(tokenizer, [streamer(out, pause=0.05)])
        try:
            req = generate_pb2.GenerateRequest(prompt="Count:", stop=["."], skip_special_tokens=True)
            res = await collect(stub, req)
            assert text_of(res) == " one two" and res[-1].finish_reason == "stop"
            assert tokenizer.decode(ids_of(res)).endswith(".")  # up to the token that completed it
            assert res[-1].usage.completion_tokens == len(ids_of(res)) < len(out)
            await asyncio.wait_for(fake.cancelled.wait(), 20)
        finally:
            await stop()
    asyncio.run(main())


@pytest.mark.slow
def test_stop_string_aborts_one_of_n(tokenizer):
    out = tokenizer.encode(" alpha beta. gamma")

    async def main():
        stub, fake, _, _, stop = await start_stack(tokenizer, [streamer(out, n=2, pause=0.02)])
        try:
            req = generate_pb2.GenerateRequest(prompt="x", stop=[" beta"], include_stop_str_in_output=True,
                                               request_id="r2")
            res = await collect(stub, req)
            for index in (0, 1):
                assert text_of(res, index) == " alpha beta"
                assert [r.finish_reason for r in res if r.index == index and not r.accepted][-1] == "stop"
            # The first to stop is aborted alone; the last one ends the call, which aborts the rest.
            await asyncio.wait_for(fake.cancelled.wait(), 20)
            for _ in range(50):
                if fake.aborts:
                    break
                await asyncio.sleep(0.05)
            assert fake.aborts == [("r2", 0)]
        finally:
            await stop()
    asyncio.run(main())


@pytest.mark.slow
def test_reattaches_after_scheduler_restart(tokenizer):
    out = tokenizer.encode(" a long answer with 世界 in it")

    async def main():
        scripts = [streamer(out, fail_after=3), streamer(out)]
        stub, fake, _, _, stop = await start_stack(tokenizer, scripts)
        try:
            res = await collect(stub, generate_pb2.GenerateRequest(prompt="Q:", request_id="r3"))
            assert sum(r.accepted for r in res) == 1
            assert ids_of(res) == out and text_of(res) == " a long answer with 世界 in it"
            again = fake.requests[1]
            assert again.attach and again.request_id == "r3" and list(again.skip_tokens) == [3]
            assert again.prompt_token_ids == fake.requests[0].prompt_token_ids
        finally:
            await stop()
    asyncio.run(main())


@pytest.mark.slow
def test_restarted_scheduler_that_lost_the_request(tokenizer):
    async def lost(request, context, fake):
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id!r} to attach to")
        yield  # pragma: no cover

    async def main():
        stub, fake, _, _, stop = await start_stack(tokenizer, [streamer([28, 29, 30], fail_after=1), lost])
        try:
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for r in stub.Generate(generate_pb2.GenerateRequest(prompt="Q:", request_id="r4"), timeout=20):
                    got.append(r)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "lost request 'r4'" in err.value.details()
            assert ids_of(got) == [28]
        finally:
            await stop()
    asyncio.run(main())


@pytest.mark.slow
def test_gives_up_when_the_scheduler_stays_away(tokenizer):
    out = tokenizer.encode(" stream")

    async def main():
        async def die(request, context, fake):
            yield accepted(request)
            yield scheduler_pb2.TokenDelta(request_id=request.request_id, token_ids=out[:1])
            await fake_server_stop()
        stub, fake, sched_server, _, stop = await start_stack(tokenizer, [die], retry_timeout=1.0)

        async def fake_server_stop():
            asyncio.get_running_loop().create_task(sched_server.stop(None))
            await asyncio.sleep(10)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, generate_pb2.GenerateRequest(prompt="Q:"))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "--scheduler-retry-timeout" in err.value.details()
        finally:
            await stop()
    asyncio.run(main())


def test_a_request_that_failed_in_the_scheduler_is_an_error_not_a_reattach(tokenizer):
    """The scheduler ends one request with its own verdict after acceptance (an exception in its
    bookkeeping: INTERNAL; an adapter the worker cannot load: INVALID_ARGUMENT): the caller gets
    that status and message after the tokens so far, and nothing re-attaches (a re-attach found the
    record ended and answered finish_reason "abort", a 200 at the gateway)."""
    out = tokenizer.encode(" one two")

    def failing(code, message):
        async def script(request, context, fake):
            yield accepted(request)
            yield scheduler_pb2.TokenDelta(request_id=request.request_id, token_ids=out[:1])
            yield scheduler_pb2.SubscriptionError(request_id=request.request_id, code=code.value[0], message=message)
        return script

    async def main():
        cases = [(grpc.StatusCode.INTERNAL, "request 'r9' failed in the scheduler"),
                 (grpc.StatusCode.INVALID_ARGUMENT, "LoRA adapter 'alien' did not load")]
        stub, fake, _, _, stop = await start_stack(tokenizer, [failing(*case) for case in cases])
        try:
            for k, (code, message) in enumerate(cases):
                got = []
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for r in stub.Generate(generate_pb2.GenerateRequest(prompt="Q:", request_id=f"r{k}"),
                                                 timeout=20):
                        got.append(r)
                assert err.value.code() == code and message in err.value.details()
                assert ids_of(got) == out[:1]
            assert [r.attach for r in fake.requests] == [False, False]
        finally:
            await stop()
    asyncio.run(main())


@pytest.mark.slow
def test_errors(tokenizer):
    async def refuse(request, context, fake):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens 99999 exceeds max_model_len 8192")
        yield  # pragma: no cover

    async def main():
        stub, fake, _, _, stop = await start_stack(tokenizer, [refuse])
        try:
            cases = [
                (generate_pb2.GenerateRequest(prompt="hi"), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens 99999"),
                (generate_pb2.GenerateRequest(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty"),
                (generate_pb2.GenerateRequest(prompt="hi", stop=["x"] * 17), grpc.StatusCode.INVALID_ARGUMENT,
                 "at most 16"),
                (generate_pb2.GenerateRequest(prompt="hi", stop=["x" * 257]), grpc.StatusCode.INVALID_ARGUMENT,
                 "256"),
                (generate_pb2.GenerateRequest(prompt="hi", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop[0]"),
                (generate_pb2.GenerateRequest(prompt_token_ids=generate_pb2.TokenIds(ids=[1, 10**6])),
                 grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[1]"),
                (generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages()), grpc.StatusCode.INVALID_ARGUMENT,
                 "the prompt is empty"),
                (generate_pb2.GenerateRequest(prompt="hi", model="other"), grpc.StatusCode.NOT_FOUND, "other"),
            ]
            for req, code, words in cases:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(stub, req)
                assert err.value.code() == code and words in err.value.details(), (req, err.value)
        finally:
            await stop()
    asyncio.run(main())


@pytest.mark.slow
def test_unreachable_scheduler_and_model_info(tokenizer):
    async def main():
        stub, _, _, _, stop = await start_stack(tokenizer, [], scheduler=False)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, generate_pb2.GenerateRequest(prompt="hi"))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == "the scheduler is not reachable (model still loading?)"
            info = await stub.GetModelInfo(generate_pb2.ModelInfoRequest())
            assert (info.model, info.vocab_size, info.ready, info.max_model_len) == \
                ("SmolLM2-135M-Instruct", len(tokenizer), False, 0)
        finally:
            await stop()
        stub, _, _, _, stop = await start_stack(tokenizer, [])
        try:
            info = await stub.GetModelInfo(generate_pb2.ModelInfoRequest())
            assert info.ready and info.max_model_len == 8192
        finally:
            await stop()
    asyncio.run(main())


@pytest.mark.slow
def test_client_cancel_cancels_the_scheduler_call(tokenizer):
    async def main():
        stub, fake, _, _, stop = await start_stack(tokenizer, [streamer([28] * 1000, pause=0.05)])
        try:
            call = stub.Generate(generate_pb2.GenerateRequest(prompt="hi"))
            got = 0
            async for _ in call:
                got += 1
                if got == 3:
                    call.cancel()
                    break
            await asyncio.wait_for(fake.cancelled.wait(), 20)
        finally:
            await stop()
    asyncio.run(main())


@pytest.mark.slow
def test_tokenize_detokenize_and_chat(tokenizer):
    async def main():
        stub, fake, _, _, stop = await start_stack(tokenizer, [streamer(tokenizer.encode("Hi!"))])
        try:
            r = await stub.Tokenize(generate_pb2.TokenizeRequest(prompt="Hello world"))
            assert list(r.token_ids) == tokenizer.encode("Hello world")
            chat = generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content="hi")],
                                             add_generation_prompt=True)
            r = await stub.Tokenize(generate_pb2.TokenizeRequest(chat=chat))
            assert r.text.endswith("<|im_start|>assistant\n") and list(r.token_ids) == tokenizer.encode(r.text)
            d = await stub.Detokenize(generate_pb2.DetokenizeRequest(token_ids=r.token_ids, skip_special_tokens=True))
            assert "<|im_start|>" not in d.text and "hi" in d.text
            res = await collect(stub, generate_pb2.GenerateRequest(chat=chat, echo=True, skip_special_tokens=False))
            assert list(fake.requests[0].prompt_token_ids) == list(r.token_ids)
            assert res[0].prompt_text == r.text and text_of(res) == "Hi!"
        finally:
            await stop()
    asyncio.run(main())


@pytest.mark.slow
def test_unset_sampling_fields_take_the_models_defaults(tokenizer):
    """The model's generation config (common/sampling_defaults.py) fills what a request left unset before
    the scheduler sees it; what the request set stays, but max_new_tokens caps max_tokens; an embedding
    request keeps its own."""
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 6}

    async def main():
        stub, fake, _, _, stop = await start_stack(tokenizer, [streamer([42])] * 3, sampling_defaults=defaults)
        try:
            plain = generate_pb2.GenerateRequest(prompt="hi", request_id="d1")
            mine = generate_pb2.GenerateRequest(prompt="hi", request_id="d2", params=common_pb2.SamplingParams(
                temperature=0.0, top_k=0, max_tokens=100))
            mine.params.min_p = 0.0
            await collect(stub, plain)
            await collect(stub, mine)
            first, second = (r.params for r in fake.requests)
            assert (first.temperature, round(first.top_p, 6), first.top_k, round(first.repetition_penalty, 6),
                    first.max_tokens) == (0.7, 0.8, 20, 1.05, 6)
            assert not first.HasField("min_p") and not first.HasField("seed")  # not in the config: the engine's
            assert (second.temperature, second.top_k, second.min_p, second.max_tokens) == (0.0, 0, 0.0, 6)
            assert round(second.top_p, 6) == 0.8
        finally:
            await stop()
    asyncio.run(main())


def test_every_served_name_is_accepted_and_the_first_named(tokenizer):
    from pagedserve.common.grpc_util import StatusError
    from pagedserve.tokenizer.service import TokenizerService

    async def main():
        service = TokenizerService(tokenizer, ["smol", "small", "smol"], f"127.0.0.1:{free_port()}")
        try:
            assert (service.served_model_name, service.served_aliases) == ("smol", ["small"])
            info = await service.model_info()  # no scheduler: not ready, the names all the same
            assert (info.model, list(info.aliases), info.ready) == ("smol", ["small"], False)
            for name in ("smol", "small", ""):
                service._check_model(name)
            with pytest.raises(StatusError, match="not served here"):
                service._check_model("large")
        finally:
            await service.close()
    asyncio.run(main())

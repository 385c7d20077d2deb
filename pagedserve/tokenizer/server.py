"""The tokenizer service: chat template and tokenization on the way in, incremental detokenization
and stop strings on the way out, with the scheduler's token stream in between.

`TokenizerService` is the logic (usable without a server), `TokenizerServicer` the thin grpc.aio
layer over it, `serve(args)` the process. Prompt and output text are never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pagedserve.common.grpc_util import SERVER_OPTIONS, MalformedRequestInterceptor, StatusError, \
    add_health_and_reflection, add_internal_port, internal_channel, set_serving
from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from pagedserve.tokenizer.detokenizer import SampleText

log = logging.getLogger("pagedserve.tokenizer")

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
UNREACHABLE = "the scheduler is not reachable (model still loading?)"
# Failures of the connection rather than verdicts on the request: after acceptance the request
# survives them in Redis, so the stream re-attaches. CANCELLED here is the scheduler's side going
# away (our own cancels never reach this code).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED})
RETRY_BACKOFF_S = (0.1, 1.0)
MODEL_INFO_TIMEOUT_S = 2.0
# Call metadata of a resumable stream (the gateway's SSE streams): when the caller vanishes without
# aborting (its gateway died), the request keeps running this many seconds (at most
# MAX_RESUME_GRACE_S) so that a client can resume it from another gateway; a caller that means to
# end the request calls the scheduler's Abort first.
RESUME_GRACE_METADATA = "pagedserve-resume-grace"
MAX_RESUME_GRACE_S = 600.0


def _resume_grace(context) -> float:
    try:
        for key, value in context.invocation_metadata() or ():
            if key == RESUME_GRACE_METADATA:
                return min(max(float(value), 0.0), MAX_RESUME_GRACE_S)
    except (TypeError, ValueError, AttributeError):
        pass
    return 0.0


@dataclass(slots=True)
class SampleState:
    text: SampleText
    received: int = 0   # tokens the scheduler sent (skip_tokens when re-attaching)
    forwarded: int = 0  # tokens passed on to the caller (usage.completion_tokens)
    finished: bool = False


@dataclass(slots=True)
class Generation:
    request_id: str
    schedule: scheduler_pb2.ScheduleRequest
    timings: common_pb2.Timings
    samples: list[SampleState] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    accepted_timings: common_pb2.Timings = field(default_factory=common_pb2.Timings)
    call: grpc.aio.UnaryStreamCall | None = None
    stopped_by_us: list[int] = field(default_factory=list)  # samples a stop string ended (n > 1)
    resume_grace_s: float = 0.0  # > 0: the scheduler stream outlives a vanished caller this long
    pending: asyncio.Future | None = None  # a read of the call in flight (resumable streams)
    detached: bool = False

    def cancel_call(self) -> None:
        if self.call is not None and not self.call.done():
            self.call.cancel()

    async def read(self):
        """The call's next message. For a resumable stream the read runs in its own task, so that
        cancelling the caller's task does not cancel the scheduler call under it."""
        if self.resume_grace_s <= 0:
            return await self.call.read()
        if self.pending is None:
            self.pending = asyncio.ensure_future(self.call.read())
        pending = self.pending
        try:
            return await asyncio.shield(pending)
        finally:
            if pending.done():
                self.pending = None


def default_served_name(model: str | None, folder: Path) -> str:
    if model and model.endswith(".gguf"):
        return Path(model).stem  # the prepared folder's name carries a cache digest
    return folder.name


def load_tokenizer(model: str | None):
    """(HF tokenizer, default served name, the model's vocab_size or None) for a folder or .gguf."""
    from pagedserve.model_files.default_model import resolve_model
    from pagedserve.model_files.tokenizer_files import load_tokenizer as load_folder_tokenizer
    folder = resolve_model(model)
    tokenizer = load_folder_tokenizer(folder)
    try:
        vocab_size = json.loads((folder / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        vocab_size = None
    return tokenizer, default_served_name(model, folder), vocab_size


class TokenizerService:
    def __init__(self, tokenizer, served_model_name: str, scheduler_addr: str,
                 scheduler_retry_timeout: float = 120.0, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.scheduler_addr = scheduler_addr
        self.retry_timeout_s = scheduler_retry_timeout
        # The model may have more embedding rows than the tokenizer has tokens.
        self.vocab_limit = max(len(tokenizer), vocab_size or 0)
        self.channel = internal_channel(scheduler_addr, aio=True)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.channel)
        # One thread: long prompts do not stall other streams, and HF tokenizers are not safe to
        # encode from several threads at once.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._token_text: dict[int, str] = {}
        self._background: set[asyncio.Task] = set()

    async def close(self) -> None:
        await self.channel.close()
        self._executor.shutdown(wait=False)

    # -- tokenization -------------------------------------------------------------------------

    def _chat(self, chat: generate_pb2.ChatMessages, tokenize: bool):
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        if not messages:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty (the chat has no messages)")
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=chat.add_generation_prompt,
                                                     tokenize=tokenize)
        except Exception as exc:  # jinja2 errors, raise_exception() in the template, no template at all
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"the model's chat template failed: {type(exc).__name__}: {exc}") from None
        if tokenize and hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out) if tokenize else out

    def _prompt_ids(self, request: generate_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("input")
        if which == "prompt":
            ids = self.tokenizer.encode(request.prompt) if request.prompt else []
        elif which == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
            for i, tid in enumerate(ids):
                if tid >= self.vocab_limit:
                    raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"prompt_token_ids[{i}] = {tid} is out of range: the vocabulary has "
                                       f"{self.vocab_limit} tokens")
        elif which == "chat":
            ids = self._chat(request.chat, tokenize=True)
        else:
            ids = []
        if not ids:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
        return ids

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def tokenize(self, request: generate_pb2.TokenizeRequest) -> generate_pb2.TokenizeResponse:
        def work():
            if request.WhichOneof("input") == "chat":
                text = self._chat(request.chat, tokenize=False)
                return self._chat(request.chat, tokenize=True), text
            return self.tokenizer.encode(request.prompt) if request.prompt else [], request.prompt
        ids, text = await self._in_thread(work)
        return generate_pb2.TokenizeResponse(token_ids=ids, text=text)

    def detokenize(self, request: generate_pb2.DetokenizeRequest) -> generate_pb2.DetokenizeResponse:
        return generate_pb2.DetokenizeResponse(
            text=self.tokenizer.decode(list(request.token_ids), skip_special_tokens=request.skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:  # bounded by the vocabulary
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    async def model_info(self) -> generate_pb2.ModelInfo:
        info = generate_pb2.ModelInfo(model=self.served_model_name, vocab_size=len(self.tokenizer))
        try:
            theirs = await self.scheduler.GetModelInfo(generate_pb2.ModelInfoRequest(), timeout=MODEL_INFO_TIMEOUT_S)
            info.max_model_len, info.ready = theirs.max_model_len, theirs.ready
        except grpc.aio.AioRpcError as exc:
            log.info("scheduler GetModelInfo failed (%s): reporting not ready", exc.code().name)
        return info

    # -- generation ---------------------------------------------------------------------------

    def _validate(self, request: generate_pb2.GenerateRequest) -> None:
        if request.model and request.model != self.served_model_name:
            raise StatusError(grpc.StatusCode.NOT_FOUND,
                               f"the model {request.model!r} is not served here (this is {self.served_model_name!r})")
        if len(request.stop) > MAX_STOP_STRINGS:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"too many stop strings: {len(request.stop)} (at most {MAX_STOP_STRINGS})")
        for i, s in enumerate(request.stop):
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"stop[{i}] has {len(s)} characters; a stop string must have 1 to "
                                   f"{MAX_STOP_STRING_CHARS}")

    def _fail_before_accept(self, exc: grpc.aio.AioRpcError) -> StatusError:
        code = exc.code()
        # The scheduler's own UNAVAILABLE (not ready, shutting down) comes over a live connection.
        if code == grpc.StatusCode.UNAVAILABLE and self.channel.get_state() != grpc.ChannelConnectivity.READY:
            log.info("scheduler at %s not reachable: %s", self.scheduler_addr, exc.details())
            return StatusError(code, UNREACHABLE)
        return StatusError(code, exc.details() or f"the scheduler failed the request ({code.name})")

    async def generate(self, request: generate_pb2.GenerateRequest, context):
        """Yield GenerateResponses; raise StatusError for a status to answer with."""
        timings = common_pb2.Timings()
        timings.CopyFrom(request.timings)
        timings.tokenizer_received = time.time()
        self._validate(request)
        prompt_ids = await self._in_thread(self._prompt_ids, request)
        timings.tokenized = time.time()
        request_id = request.request_id or f"tok-{uuid.uuid4().hex}"
        gen = Generation(request_id, scheduler_pb2.ScheduleRequest(
            request_id=request_id, prompt_token_ids=prompt_ids, params=request.params, priority=request.priority,
            timings=timings), timings)
        gen.resume_grace_s = _resume_grace(context)
        context.add_done_callback(lambda ctx: self._caller_done(gen, ctx))
        caller_gone = False
        try:
            gen.call = self.scheduler.Generate(gen.schedule, timeout=context.time_remaining())
            try:
                first = await gen.call.read()
            except grpc.aio.AioRpcError as exc:
                raise self._fail_before_accept(exc) from None
            if first is grpc.aio.EOF or not first.accepted:
                raise StatusError(grpc.StatusCode.INTERNAL, "the scheduler's stream did not start with accepted")
            gen.request_id = gen.schedule.request_id = first.request_id or request_id
            gen.prompt_tokens = first.num_prompt_tokens or len(prompt_ids)
            gen.cached_tokens = first.num_cached_tokens
            gen.accepted_timings.CopyFrom(first.timings)
            for _ in range(max(1, first.n or request.params.n)):
                gen.samples.append(SampleState(SampleText(self.tokenizer, prompt_ids, request.skip_special_tokens,
                                                          list(request.stop), request.include_stop_str_in_output)))
            log.debug("request %s accepted: %d prompt tokens, n=%d", gen.request_id, gen.prompt_tokens,
                      len(gen.samples))
            accepted = generate_pb2.GenerateResponse(request_id=gen.request_id, accepted=True)
            accepted.usage.prompt_tokens = gen.prompt_tokens
            if request.echo:
                accepted.prompt_text = request.prompt if request.WhichOneof("input") == "prompt" else \
                    self.tokenizer.decode(prompt_ids, skip_special_tokens=request.skip_special_tokens)
            yield accepted
            async for response in self._stream(gen, context):
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            caller_gone = True
            raise
        finally:
            if caller_gone and gen.resume_grace_s > 0:
                self._detach(gen)
            elif not gen.detached:
                gen.cancel_call()  # stop hit with n == 1, caller gone, or an error: the scheduler aborts

    def _caller_done(self, gen: Generation, context) -> None:
        if gen.resume_grace_s > 0 and context.cancelled():
            self._detach(gen)
        elif not gen.detached:
            gen.cancel_call()

    def _detach(self, gen: Generation) -> None:
        """The caller of a resumable stream vanished: keep the request running for its grace."""
        if gen.detached or gen.call is None or gen.call.done() or (gen.samples and all(
                s.finished for s in gen.samples)):
            return
        gen.detached = True
        log.info("request %s: its caller went away; it keeps running %.0f s for a resume", gen.request_id,
                 gen.resume_grace_s)
        self._spawn(self._linger(gen))

    async def _linger(self, gen: Generation) -> None:
        deadline = time.monotonic() + gen.resume_grace_s
        finished = [s.finished for s in gen.samples]
        try:
            while not (finished and all(finished)):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                read = gen.pending if gen.pending is not None else asyncio.ensure_future(gen.call.read())
                gen.pending = None
                try:
                    delta = await asyncio.wait_for(read, left)
                except (asyncio.TimeoutError, asyncio.CancelledError, grpc.aio.AioRpcError):
                    break
                if delta is grpc.aio.EOF:
                    break
                if not delta.accepted and delta.finish_reason and delta.index < len(finished):
                    finished[delta.index] = True
        finally:
            gen.cancel_call()  # still orphaned: the scheduler aborts it; resumed: the resumer holds it

    async def _stream(self, gen: Generation, context):
        retry_until = None  # set while the scheduler is away
        while True:
            try:
                delta = await gen.read()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise StatusError(exc.code(), exc.details() or exc.code().name) from None
                delta = None
            # EOF before every sample finished: the scheduler went away cleanly mid-request.
            if delta is None or delta is grpc.aio.EOF:
                log.info("request %s: the scheduler stream broke, re-attaching", gen.request_id)
                retry_until = retry_until or time.monotonic() + self.retry_timeout_s
                await self._reattach(gen, context, retry_until)
                continue
            if delta.accepted:
                continue
            retry_until = None
            response, stopped = self._on_delta(gen, delta)
            if response is not None:
                yield response
            if all(s.finished for s in gen.samples):
                log.debug("request %s finished", gen.request_id)
                return
            if stopped:
                self._abort_sample(gen, delta.index)

    def _on_delta(self, gen: Generation, delta: scheduler_pb2.TokenDelta):
        """The response for one scheduler delta (None when there is nothing to say), and whether a
        stop string ended a sample the scheduler is still generating."""
        if delta.index >= len(gen.samples):
            log.warning("request %s: delta for sample %d of %d ignored", gen.request_id, delta.index,
                        len(gen.samples))
            return None, False
        s = gen.samples[delta.index]
        s.received += len(delta.token_ids)
        gen.cached_tokens = max(gen.cached_tokens, delta.num_cached_tokens)  # known once it is scheduled
        if s.finished:
            return None, False
        text, used, stopped = s.text.push(delta.token_ids, final=bool(delta.finish_reason))
        response = generate_pb2.GenerateResponse(request_id=gen.request_id, index=delta.index, text=text,
                                                 token_ids=delta.token_ids[:used])
        if len(delta.logprobs) == len(delta.token_ids):
            for lp in delta.logprobs[:used]:
                self._add_logprob(response, lp)
        s.forwarded += used
        finish = "stop" if stopped else delta.finish_reason
        if not finish:
            return (response if response.text or response.token_ids else None), False
        s.finished = True
        response.finish_reason = finish
        response.usage.prompt_tokens = gen.prompt_tokens
        response.usage.completion_tokens = s.forwarded
        response.usage.cached_tokens = gen.cached_tokens
        response.timings.CopyFrom(gen.timings)
        response.timings.MergeFrom(gen.accepted_timings)
        response.timings.MergeFrom(delta.timings)
        response.timings.detokenized = time.time()
        # The scheduler still generates this sample only if it had not finished it itself.
        return response, stopped and not delta.finish_reason

    def _add_logprob(self, response: generate_pb2.GenerateResponse, lp: common_pb2.TokenLogprob) -> None:
        out = response.logprobs.add()
        out.CopyFrom(lp)
        out.token = self.token_text(lp.token_id)
        for top in out.top:
            top.token = self.token_text(top.token_id)

    def _abort_sample(self, gen: Generation, index: int) -> None:
        if len(gen.samples) == 1:
            gen.cancel_call()  # cancelling the stream aborts the request at the scheduler
            return
        gen.stopped_by_us.append(index)
        self._spawn(self._send_abort(gen.request_id, index))

    async def _send_abort(self, request_id: str, index: int) -> None:
        try:
            await self.scheduler.Abort(scheduler_pb2.AbortRequest(request_id=request_id, index=index),
                                       timeout=MODEL_INFO_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.info("request %s: abort of sample %d failed (%s)", request_id, index, exc.code().name)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reattach(self, gen: Generation, context, retry_until: float) -> None:
        """Open a new scheduler stream for gen, past the tokens already received, or raise."""
        attach = scheduler_pb2.ScheduleRequest()
        attach.CopyFrom(gen.schedule)
        attach.attach = True
        attach.skip_tokens.extend(s.received for s in gen.samples)
        delay = RETRY_BACKOFF_S[0]
        while True:
            left = retry_until - time.monotonic()
            if left <= 0:
                raise StatusError(grpc.StatusCode.UNAVAILABLE,
                                   f"the scheduler did not come back within --scheduler-retry-timeout "
                                   f"({self.retry_timeout_s:g} s)")
            gen.call = self.scheduler.Generate(attach, wait_for_ready=True, timeout=context.time_remaining())
            try:
                first = await asyncio.wait_for(gen.call.read(), left)
            except asyncio.TimeoutError:
                gen.cancel_call()
                continue  # the loop head reports the timeout
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    # Not the caller's mistake: the restarted scheduler had no durable record of it.
                    raise StatusError(grpc.StatusCode.UNAVAILABLE,
                                       f"the scheduler restarted and lost request {gen.request_id!r} "
                                       f"(is it running without Redis?): {exc.details()}") from None
                if exc.code() not in RETRYABLE:
                    raise StatusError(exc.code(), exc.details() or exc.code().name) from None
                await asyncio.sleep(min(delay, max(0.0, retry_until - time.monotonic())))
                delay = min(delay * 2, RETRY_BACKOFF_S[1])
                continue
            if first is grpc.aio.EOF or not first.accepted:
                raise StatusError(grpc.StatusCode.INTERNAL,
                                   "the scheduler's re-attached stream did not start with accepted")
            log.info("request %s re-attached", gen.request_id)
            for index in gen.stopped_by_us:  # a restarted scheduler does not know about them
                self._spawn(self._send_abort(gen.request_id, index))
            return


class TokenizerServicer(generate_pb2_grpc.TokenizerServicer):
    """gRPC over TokenizerService; `service` is None while the tokenizer loads."""

    def __init__(self, service: TokenizerService | None = None) -> None:
        self.service = service

    async def _service(self, context) -> TokenizerService:
        if self.service is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the tokenizer is still loading")
        return self.service

    async def Generate(self, request, context):
        service = await self._service(context)
        try:
            async for response in service.generate(request, context):
                yield response
        except StatusError as exc:
            await context.abort(exc.code, exc.details)

    async def Tokenize(self, request, context):
        try:
            return await (await self._service(context)).tokenize(request)
        except StatusError as exc:
            await context.abort(exc.code, exc.details)

    async def Detokenize(self, request, context):
        return (await self._service(context)).detokenize(request)

    async def GetModelInfo(self, request, context):
        return await (await self._service(context)).model_info()


async def _serve(args) -> int:
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[MalformedRequestInterceptor()])
    servicer = TokenizerServicer()
    generate_pb2_grpc.add_TokenizerServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    address = f"{args.host}:{args.port}"
    try:
        add_internal_port(server, address)
    except RuntimeError as exc:
        log.error("cannot listen on %s: %s", address, exc)
        return 1
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("tokenizer listening on %s (loading the tokenizer)", address)
    loader = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, args.model))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([loader, stopper], return_when=asyncio.FIRST_COMPLETED)
    if not loader.done():
        loader.cancel()
        await server.stop(grace=None)
        return 0
    try:
        tokenizer, default_name, vocab_size = loader.result()
    except Exception as exc:
        log.error("could not load the tokenizer: %s", exc)
        await server.stop(grace=None)
        return 1
    # Built here, not in the loader's thread: the scheduler channel belongs to this event loop.
    service = TokenizerService(tokenizer, args.served_model_name or default_name, args.scheduler_addr,
                               args.scheduler_retry_timeout, vocab_size)
    servicer.service = service
    set_serving(health, [SERVICE_NAME])
    log.info("tokenizer serving %s on %s (scheduler at %s)", service.served_model_name, address,
             args.scheduler_addr)
    await stopper
    log.info("tokenizer shutting down")
    set_serving(health, [SERVICE_NAME], serving=False)
    await server.stop(grace=5.0)
    await service.close()
    return 0


def serve(args) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_serve(args))

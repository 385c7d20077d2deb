"""One REST completions or chat call (or a resumed stream), from admission to its end:
`CompletionCall` checks and forwards the request to the tokenizer's Generate stream, waits for
it to be accepted (errors until then are plain HTTP errors), then answers with SSE (`stream`) or
one JSON body collected to the end (completion_answer.py).

Lifecycle and its invariants:
  - accepted: the tokenizer's first message came; the call is in backend.inflight (the drain
    waits for it) and holds its tokens-in-flight reservation (admission.reserve);
  - ended, exactly once (`end`): the metrics tracker is finished, the call leaves
    backend.inflight and its reservation is released, whether it ran to its end, failed, timed
    out, was left by its client or was aborted by the drain;
  - a client that leaves an unfinished call aborts its request at the scheduler, unless another
    stream shares the request (an idempotent retry, a resume): then the tokenizer's resume grace
    ends it if nobody comes back;
  - a timeout that passes aborts the request (its KV blocks are freed), in-band for a stream
    (the headers are gone) and as a 504 otherwise.
Threads: everything runs on the serving event loop; aborts whose answer nobody waits for run as
background tasks (spawn), kept referenced until done.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
import uuid

import grpc
from fastapi import Request
from fastapi.responses import Response

from pagedserve.common import request_checks as checks
from pagedserve.v1 import common_pb2, generate_pb2
from pagedserve.gateway import images
from pagedserve.gateway.admission import Refusal
from pagedserve.gateway.backend import Backend, as_request_error, rpc_error
from pagedserve.gateway.generation import admit_first, forward_as, output_budget
from pagedserve.gateway.metrics import RequestTracker
from pagedserve.gateway.owners import SINGLE_TENANT, Caller, valid_client_id
from pagedserve.gateway.protocol import (ChatCompletionRequest, CompletionRequest, RequestError, chat_echo_text,
                                         chat_to_generate, completion_to_generate, embedding_to_generate,
                                         include_event_ids, continuous_usage, include_usage)
from pagedserve.gateway.reasoning import request_parser, structured_end
from pagedserve.gateway.responses import Reasoning
from pagedserve.gateway.structured import compiles_a_grammar
from pagedserve.gateway.tools import ToolOutput, chat_tools
from pagedserve.gateway.background import spawn
from pagedserve.gateway.beam_call import check_beam_request, run_beam_search
from pagedserve.gateway.completion_answer import respond
from pagedserve.gateway.sse import Cursor, ResumeSkip

# The tokenizer keeps a stream's request running this long after its caller vanished without
# aborting it (this gateway died), so that the client can resume it from another gateway.
RESUME_GRACE_METADATA = "pagedserve-resume-grace"

log = logging.getLogger("pagedserve.gateway")

class CompletionCall:
    """One completions/chat call (or a resumed stream): accepted before headers, then streamed
    or collected."""

    def __init__(self, backend: Backend, request: Request, chat: bool,
                 body: CompletionRequest | ChatCompletionRequest | None) -> None:
        self.backend, self.request, self.chat, self.body = backend, request, chat, body
        self.received = time.time()
        self.tracker: RequestTracker | None = backend.metrics.track(self.received)
        self.call = None
        self.client_gone = False
        self.finished = False
        self.shutdown = False  # aborted by the gateway's drain
        self.reserved = 0      # tokens counted in the admission's tokens_in_flight
        self.prompt_tokens = 0  # the prompt's tokens, once the tokenizer accepted the request
        # The owner (set by the HTTP gate) and the two names of the request: the client's id (in the
        # chunks and x-request-id) and the internal one the services know (owners.py).
        self.caller: Caller = getattr(request.state, "caller", SINGLE_TENANT)
        self.client_id = ""
        self.request_id = ""
        # Another stream may share the request (an idempotent retry, a resume): then a client that
        # leaves does not abort it; the tokenizer's resume grace ends it if nobody is left.
        self.shared = False
        self.n = 1  # a resume learns its n from the record; until then (or when there is none) one sample
        self.continuous_usage = False  # vLLM's continuous_usage_stats: usage on every chunk
        self.raw = False  # one prompt of a batch (batched_completion.py): answer chunks / a body, no Response
        self.tools: ToolOutput | None = None  # how a chat's samples are read for tool calls
        self.reasoning: Reasoning | None = None  # and for their reasoning (--reasoning-parser)
        # An embedding (embeddings.py): the prompt runs alone and the answer is its pooled vector.
        self.pooling: common_pb2.Pooling | None = None
        self.chat_echo = ""
        # vLLM's return_token_ids (the prompt's and the output's ids in the response) and
        # return_tokens_as_token_ids (logprob tokens as "token_id:<id>"; unset: the server's)
        self.token_ids = bool(getattr(body, "return_token_ids", None))
        as_ids = getattr(body, "return_tokens_as_token_ids", None)
        self.ids_as_tokens = backend.return_tokens_as_token_ids if as_ids is None else as_ids
        if body is not None:
            self.n, self.stream = body.n, body.stream
            self.logprobs = bool(body.logprobs) if chat else body.logprobs is not None
            self.echo = not chat and body.echo
            self.chat_echo = chat_echo_text(body) if chat else ""  # vLLM's chat echo: the answer's prefix
            self.usage, self.timings = include_usage(body), body.timings
            self.continuous_usage = continuous_usage(body)
            self.event_ids = include_event_ids(body)

    def _metadata(self):
        grace = self.backend.limits.resume_grace_s
        return ((RESUME_GRACE_METADATA, f"{grace:g}"),) if self.stream and grace > 0 else None

    def _timeout(self) -> float | None:
        timeout = getattr(self.body, "timeout", None)
        if timeout is None:
            return None
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise RequestError(400, f"timeout must be a positive number of seconds, got {timeout!r}", "timeout")
        return float(timeout)

    def _mapped(self, body) -> tuple[generate_pb2.GenerateRequest, ToolOutput | None]:
        """The body as a GenerateRequest and its tools' reading; 400 (RequestError) when it is bad."""
        gen = chat_to_generate(body) if self.chat else completion_to_generate(body)
        return gen, chat_tools(body, gen, self.backend.tool_call_parser) if self.chat else None

    async def start(self) -> Response:
        body, backend = self.body, self.backend
        backend.admission.check_n(body.n)
        backend.admission.check_priority(self.caller, body.priority)
        timeout = self._timeout()
        info = await backend.served_model(body.model)
        if self.pooling is not None:
            gen = embedding_to_generate(body.prompt, self.pooling, body.priority)
        elif compiles_a_grammar(body):  # (seconds for a large schema: never on the streams' event loop)
            gen, self.tools = await asyncio.to_thread(self._mapped, body)
        else:
            gen, self.tools = self._mapped(body)
        if self.chat:
            if backend.reasoning_parser:
                self.reasoning = Reasoning(request_parser(backend.reasoning_parser, body.chat_template_kwargs))
                if self.reasoning.parser and gen.params.HasField("structured_output"):
                    # vLLM's: structured outputs and forced tool calls constrain what follows the reasoning
                    gen.params.structured_output.reasoning_end = structured_end(self.reasoning.parser)
        name = "max_completion_tokens" if self.chat and body.max_completion_tokens is not None else "max_tokens"
        problem = checks.max_tokens_problem(output_budget(gen), info.max_model_len, name)
        if problem:
            raise RequestError(400, problem, name)
        problem = checks.truncation_problem(body.truncate_prompt_tokens, info.max_model_len)
        if problem:
            raise RequestError(400, problem, "truncate_prompt_tokens")
        if body.truncate_prompt_tokens is not None:
            gen.truncate_prompt_tokens = info.max_model_len if body.truncate_prompt_tokens == -1 \
                else body.truncate_prompt_tokens
        problem = checks.prompt_chars_problem(gen, info.max_model_len)
        if problem:
            raise RequestError(400, problem, "messages" if self.chat else "prompt", code="context_length_exceeded")
        problem = (checks.params_vocab_problem(gen.params, info.vocab_size)
                   or checks.logprobs_problem(gen.params, checks.served_logprobs_limit(info)))
        if problem and self.chat and problem.startswith("logprobs "):  # a chat asks by top_logprobs
            problem = "top_" + problem
        if problem:
            raise RequestError(400, problem, problem.split()[0])
        if self.chat:  # images: the model takes them, within the limit, URLs fetched, each one an image
            await images.resolve(gen.chat, info, backend.media, backend.media_client())
        client_id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        beams = check_beam_request(body, checks.served_logprobs_limit(info))
        if beams is not None:  # vLLM's use_beam_search: steps of one-token requests (beam_call.py)
            if self.request.headers.get("idempotency-key"):
                raise RequestError(400, "Idempotency-Key is not supported with use_beam_search", "use_beam_search")
            if self.chat and images.image_count(gen.chat):  # its later steps send the beams' token ids alone
                raise RequestError(400, "images are not supported with use_beam_search", "use_beam_search")
            self.client_id, self.created = client_id, int(self.received)
            self.model = gen.params.lora_name or gen.model or info.model
            return await run_beam_search(self, gen, beams, info, timeout)
        key = self.request.headers.get("idempotency-key")
        if key:
            # A retried POST (same owner, same body) attaches to the first one's generation and
            # replays it from the start; the key is the owner's, so nobody else's POST finds it.
            digest = hashlib.sha256(body.model_dump_json().encode()).hexdigest()[:32]
            mine = client_id
            client_id = await backend.claim_idempotency_key(self.caller.owner, key, client_id, digest)
            self.shared = True
            if client_id == mine:  # our claim: a refusal below must not leave it behind
                try:
                    return await self._generate(gen, info, client_id, timeout)
                except BaseException:  # refused before any answer: the key is free for a retry
                    await backend.release_idempotency_key(self.caller.owner, key, client_id, digest)
                    raise
        return await self._generate(gen, info, client_id, timeout)

    async def _generate(self, gen: generate_pb2.GenerateRequest, info: generate_pb2.ModelInfo, client_id: str,
                        timeout: float | None) -> Response:
        """Send the request on under the caller's internal id; answer once the tokenizer accepts it."""
        body, backend = self.body, self.backend
        request_id = forward_as(gen, self.caller, client_id, self.received, backend.prefix_cache_scope, backend.loras)
        self.tracker.request_id = request_id
        self.tracker.adapter = gen.params.lora_name
        # an adapter's answers name it; a request that names one of the served names is answered under it (vLLM's)
        self.model = gen.params.lora_name or gen.model or info.model
        self.client_id, self.request_id, self.created = client_id, request_id, int(self.received)

        self.call = backend.tokenizer.Generate(gen, timeout=timeout, metadata=self._metadata())
        first = await self._first()
        self.prompt_tokens = first.usage.prompt_tokens
        try:
            self.reserved = await admit_first(backend, self.call, request_id, first, body.n, output_budget(gen),
                                              info.max_model_len)
        except Refusal:
            self.end()
            raise
        if self.stream:  # only once accepted: a refused request leaves nothing in the store
            await backend.resume_records.save(request_id, {
                "chat": self.chat, "model": info.model, "created": self.created, "n": body.n,
                "logprobs": self.logprobs, "usage": self.usage, "timings": self.timings,
                "continuous_usage": self.continuous_usage,
                "token_ids": self.token_ids, "ids_as_tokens": self.ids_as_tokens, "chat_echo": self.chat_echo,
                "stop": list(gen.stop), "include_stop_str_in_output": gen.include_stop_str_in_output,
                "skip_special_tokens": gen.skip_special_tokens,
                "tools": self.tools.state() if self.tools else None,
                "reasoning": [self.reasoning.parser] if self.reasoning else None})
        return await respond(self, first)

    async def resume(self, request_id: str, last_event_id: str | None, after: str | None) -> Response:
        """GET /v1/requests/{id}/stream: replay the request from the start through the tokenizer
        (it re-attaches at the scheduler, which replays from Redis and goes on live), dropping what
        the client already has."""
        backend = self.backend
        if not valid_client_id(request_id):
            raise RequestError(404, f"no request with id {request_id!r}", "request_id", code="request_not_found")
        self.client_id, request_id = request_id, self.caller.internal_id(request_id)
        cursor_text = last_event_id if last_event_id not in (None, "") else after
        skip = None
        if cursor_text not in (None, ""):
            try:
                tokens, chars, done = Cursor.parse(cursor_text)
            except ValueError:
                raise RequestError(400, f"cannot parse the stream position {cursor_text!r}: want the SSE event id "
                                   "(T:C[,T:C...]) in Last-Event-ID, or ?after=T (tokens)",
                                   "Last-Event-ID" if last_event_id else "after") from None
            if last_event_id in (None, ""):
                chars = [None] * len(tokens)
        record = await backend.get_record(request_id, self.client_id)
        meta = await backend.resume_records.load(request_id) or {}
        n = int(meta.get("n") or len(record.outputs) or record.params.n or 1)
        self.chat = bool(meta.get("chat", self.client_id.startswith("chatcmpl-")))
        self.n, self.stream, self.logprobs, self.echo = n, True, bool(meta.get("logprobs")), False
        self.usage, self.timings = bool(meta.get("usage")), False
        self.continuous_usage = bool(meta.get("continuous_usage"))
        self.token_ids, self.ids_as_tokens = bool(meta.get("token_ids")), bool(meta.get("ids_as_tokens"))
        self.chat_echo = str(meta.get("chat_echo") or "")
        self.event_ids = True  # a client that resumes reads the cursor; only our own endpoint sends it
        self.tools = ToolOutput.from_state(meta.get("tools"))
        self.reasoning = Reasoning(meta["reasoning"][0]) if meta.get("reasoning") else None
        info = await backend.model_info()
        self.model, self.created = meta.get("model") or info.model, int(meta.get("created") or self.received)
        self.request_id = self.tracker.request_id = request_id
        self.shared = True
        gen = generate_pb2.GenerateRequest(request_id=request_id, params=record.params,
                                           stop=list(meta.get("stop") or []),
                                           include_stop_str_in_output=bool(meta.get("include_stop_str_in_output")),
                                           skip_special_tokens=bool(meta.get("skip_special_tokens", True)))
        gen.prompt_token_ids.ids.extend(record.prompt_token_ids)
        # A resumed stream shows no echo or prompt logprobs (its client had them in its first
        # chunks): without the field the scheduler's replay leaves them out (DeltaFilter).
        gen.params.ClearField("prompt_logprobs")
        # and the prompt's ids only to a client that starts over (a cursor: it has them)
        gen.return_token_ids = self.token_ids and cursor_text in (None, "")
        if cursor_text not in (None, ""):
            tokens += [0] * (n - len(tokens))
            chars += [0] * (n - len(chars))
            done += [False] * (n - len(done))
            skip = ResumeSkip(backend.tokenizer, tokens, chars, done, gen.skip_special_tokens)
        self.call = backend.tokenizer.Generate(gen, metadata=self._metadata())
        first = await self._first()
        return await respond(self, first, skip)

    async def _first(self) -> generate_pb2.GenerateResponse:
        try:
            first = await self.call.read()
        except grpc.RpcError as exc:
            self.end()
            raise rpc_error(exc) from exc
        except BaseException:
            self.end()
            self.call.cancel()
            raise
        if first is grpc.aio.EOF:
            self.end()
            raise RequestError(500, "the tokenizer service ended the stream before accepting the request",
                               type="server_error")
        self.backend.inflight.add(self)
        return first

    def end(self, cancelled: bool = False) -> None:
        """Once: the request leaves this gateway's books."""
        if self.tracker is not None:
            self.tracker.finish(self.n, cancelled=cancelled)
            self.tracker = None
        self.backend.inflight.discard(self)
        self.backend.admission.release(self.reserved)
        self.reserved = 0

    def _closed(self) -> None:
        """The response ended: a stream not run to its end was left by its client, so its request
        is aborted here (the tokenizer would otherwise keep it for a resume)."""
        if not self.finished and self.call is not None:
            self.client_gone = True
            if self.request_id and not self.shared:
                spawn(self.backend.abort(self.request_id))
        if self.call is not None:
            self.call.cancel()
        self.end(cancelled=not self.finished)

    def abort_for_shutdown(self) -> None:
        """The drain gave up waiting: abort the request; its stream ends with an error event."""
        self.shutdown = True
        spawn(self.backend.abort(self.request_id))

    def _disconnected(self) -> None:
        self.client_gone = True
        self.call.cancel()


async def run_completion(backend: Backend, request: Request, chat: bool,
                         body: CompletionRequest | ChatCompletionRequest) -> Response:
    """POST /v1/completions and /v1/chat/completions; any failure before the headers is an HTTP error."""
    try:
        return await CompletionCall(backend, request, chat, body).start()
    except RequestError:
        raise
    except Exception as exc:
        raise as_request_error(exc) from exc


async def resume_stream(backend: Backend, request: Request, request_id: str, last_event_id: str | None,
                        after: str | None) -> Response:
    """GET /v1/requests/{id}/stream."""
    call = CompletionCall(backend, request, request_id.startswith("chatcmpl-"), None)
    try:
        return await call.resume(request_id, last_event_id, after)
    except RequestError:
        call.end()
        raise
    except grpc.RpcError as exc:
        call.end()
        raise rpc_error(exc) from exc

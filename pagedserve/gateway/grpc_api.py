"""The public gRPC Generation service: the same stream the tokenizer service produces, behind the
gateway's admission (admission.py, shared with the REST API: draining, API key, rate limit, --max-n,
tokens in flight; the server's message size limit is --max-body-bytes) and model check, with the
gateway's receive stamp (a client's own timings are dropped).

Ids: the client's `request_id` (validated: owners.CLIENT_ID_PATTERN) is the caller's; downstream
the request is known by the internal id owner.client_id (owners.py), so a Generate naming an id
attaches to the caller's own request of that id, never another owner's, and every response goes
back with the client's id.

The servicer translates protobuf only: a Refusal aborts the call with its gRPC status and message;
a downstream error is passed on with its own status and details.
Threads: runs on the serving event loop (shared with the REST API). Invariants: the downstream
call is cancelled whenever the handler ends (client cancellation, deadline, error, or the end of
the stream); a tokens-in-flight reservation is released then too.
"""

from __future__ import annotations

import asyncio

import time
import uuid
from urllib.parse import unquote

import grpc

from pagedserve.v1 import generate_pb2, generate_pb2_grpc
from pagedserve.common import request_checks as checks
from pagedserve.common import structured_output
from pagedserve.common.wire import params_from_proto
from pagedserve.gateway import grpc_embed, images
from pagedserve.gateway.admission import Refusal
from pagedserve.gateway.backend import RPC_TIMEOUT_S, Backend
from pagedserve.gateway.generation import admit_first, forward_as, output_budget
from pagedserve.gateway.errors import RequestError
from pagedserve.gateway.lora_adapters import LoraAdapters, load_from_body, unload_from_body
from pagedserve.gateway.owners import Caller, client_id_problem, valid_client_id

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_UNBOUNDED = 2**31 - 1


def peer_host(peer: str | None) -> str | None:
    """The client's address without the port, as REST sees it: 'ipv4:1.2.3.4:5' -> '1.2.3.4',
    'ipv6:[::1]:5' -> '::1'; any other peer (a unix socket) as it is."""
    if not peer:
        return None
    kind, _, rest = unquote(peer).partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].strip("[]") or rest
    return peer


def _no_such_model(model: str) -> str:
    return f"the model {model!r} does not exist"


def request_problem(request: generate_pb2.GenerateRequest, info: generate_pb2.ModelInfo,
                    adapters: LoraAdapters | None = None) -> tuple[grpc.StatusCode, str] | None:
    """What is wrong with a GenerateRequest for the served model or one of its LoRA adapters
    (status and message), or None."""
    if checks.other_model(request.model, info) and (adapters is None or adapters.path_of(request.model) is None):
        return grpc.StatusCode.NOT_FOUND, _no_such_model(request.model)
    if not info.ready:
        return grpc.StatusCode.UNAVAILABLE, "the model is loading"
    if request.WhichOneof("input") is None:
        return grpc.StatusCode.INVALID_ARGUMENT, "one of prompt, prompt_token_ids or chat is required"
    if request.request_id and not valid_client_id(request.request_id):
        return grpc.StatusCode.INVALID_ARGUMENT, client_id_problem(request.request_id)
    problem = checks.prompt_chars_problem(request, info.max_model_len)
    if problem:
        return grpc.StatusCode.INVALID_ARGUMENT, problem
    try:
        params = params_from_proto(request.params, default_max_tokens=_UNBOUNDED)
        if params.structured_output is not None:
            structured_output.check(params.structured_output)
    except ValueError as exc:
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    problem = (checks.params_vocab_problem(params, info.vocab_size)
               or checks.logprobs_problem(params, checks.served_logprobs_limit(info)))
    return None if problem is None else (grpc.StatusCode.INVALID_ARGUMENT, problem)


class GenerationService(generate_pb2_grpc.GenerationServicer):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def _admit(self, context: grpc.aio.ServicerContext, n: int | None = None) -> Caller:
        """The shared admission, as REST does it for every /v1 request; n: Generate's samples."""
        metadata = {key.lower(): value for key, value in (context.invocation_metadata() or ())}
        admission = self.backend.admission
        try:
            caller = await admission.admit(metadata.get("authorization"), peer_host(context.peer()))
            if n is not None:
                admission.check_n(n)
        except Refusal as refusal:
            await context.abort(refusal.grpc_code, refusal.message)
        return caller

    async def _model_info(self, context: grpc.aio.ServicerContext, request=None) -> generate_pb2.ModelInfo:
        """The served model; a request given is held to --max-body-bytes unless the model takes images
        (gRPC's own cap makes room for images: server.py)."""
        try:
            info = await self.backend.model_info_rpc(_timeout(context, RPC_TIMEOUT_S))
        except grpc.RpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
            raise  # not reached: abort raises
        if request is not None and not info.takes_images:
            try:
                self.backend.admission.check_body_size(request.ByteSize())
            except Refusal as refusal:
                await context.abort(refusal.grpc_code, refusal.message)
        return info

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        received = time.time()
        n = request.params.n or 1
        caller = await self._admit(context, n)
        try:
            self.backend.admission.check_priority(caller, request.priority)
        except Refusal as refusal:
            await context.abort(refusal.grpc_code, refusal.message)
        if self.backend.runner == "pooling":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "The model does not support generation: this server runs --runner pooling (use Embed)")
        info = await self._model_info(context, request)
        if checks.other_model(request.model, info):
            await self.backend.loras.sync(request.model)
        if request.params.HasField("structured_output"):  # compiles a grammar: off the event loop
            problem = await asyncio.to_thread(request_problem, request, info, self.backend.loras)
        else:
            problem = request_problem(request, info, self.backend.loras)
        if problem is not None:
            await context.abort(*problem)

        forward = generate_pb2.GenerateRequest()
        forward.CopyFrom(request)
        try:  # a chat's images: the model takes them, within the limit, URLs fetched (images.py)
            await images.resolve(forward.chat, info, self.backend.media, self.backend.media_client(), "parts")
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        client_id = request.request_id or "cmpl-" + uuid.uuid4().hex
        request_id = forward_as(forward, caller, client_id, received, self.backend.prefix_cache_scope,
                                self.backend.loras)
        admission, tracker = self.backend.admission, self.backend.metrics.track(received)
        tracker.request_id = request_id
        tracker.adapter = forward.params.lora_name
        # The client's deadline goes downstream; its cancellation cancels this handler, whose
        # finally cancels the downstream call (the scheduler then aborts and frees the KV blocks).
        # context.write rather than yield: a generator suspended at a yield when the cancellation
        # lands would only run its finally whenever it is garbage-collected.
        call = self.backend.tokenizer.Generate(forward, timeout=context.time_remaining())
        finished, accepted, reserved = False, False, 0
        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                tracker.on_message(msg)
                if not accepted:  # the first message: the prompt is counted, so are the tokens in flight
                    reserved = await admit_first(self.backend, call, request_id, msg, n, output_budget(forward),
                                                 info.max_model_len)
                    accepted = True
                msg.request_id = client_id
                await context.write(msg)
            finished = True
        except Refusal as refusal:  # admit_first cancelled the call and aborted the request
            finished = True
            await context.abort(refusal.grpc_code, refusal.message)
        except grpc.RpcError as exc:
            finished = True
            await context.abort(exc.code(), exc.details() or "")
        finally:
            call.cancel()
            admission.release(reserved)
            tracker.finish(n, cancelled=not finished)

    async def Embed(self, request: generate_pb2.EmbedRequest, context: grpc.aio.ServicerContext):
        """As POST /v1/embeddings (grpc_embed.py)."""
        metadata = {key.lower(): value for key, value in (context.invocation_metadata() or ())}
        return await grpc_embed.embed(self, request, context, metadata, peer_host(context.peer()))

    async def GetModelInfo(self, request: generate_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext):
        await self._admit(context)
        return await self._model_info(context)

    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        """As POST /tokenize (the tokenizer does the work: tokenizer/tokenization.py)."""
        info = await self._checked_model(request, context)
        reply = await self._forward(self.backend.tokenizer.Tokenize, request, context)
        reply.max_model_len = info.max_model_len
        return reply

    async def Detokenize(self, request: generate_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext):
        """As POST /detokenize (but skip_special_tokens is the caller's)."""
        await self._checked_model(request, context)
        return await self._forward(self.backend.tokenizer.Detokenize, request, context)

    async def LoadLoraAdapter(self, request: generate_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext):
        """As POST /v1/load_lora_adapter (the operator key only)."""
        await self._operator(context)
        return await self._adapters(context, lambda body: load_from_body(self.backend.loras, body),
                                    {"lora_name": request.lora_name, "lora_path": request.lora_path})

    async def UnloadLoraAdapter(self, request: generate_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext):
        """As POST /v1/unload_lora_adapter (the operator key only)."""
        await self._operator(context)
        return await self._adapters(context, lambda body: unload_from_body(self.backend.loras, body),
                                    {"lora_name": request.lora_name})

    async def _operator(self, context: grpc.aio.ServicerContext) -> None:
        if not (await self._admit(context)).admin:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this call wants the operator key (--admin-api-key)")

    @staticmethod
    async def _adapters(context: grpc.aio.ServicerContext, change, body: dict) -> generate_pb2.LoraAdapterReply:
        try:
            return generate_pb2.LoraAdapterReply(message=await change(body))
        except RequestError as exc:
            code = {404: grpc.StatusCode.NOT_FOUND, 503: grpc.StatusCode.UNAVAILABLE}.get(
                exc.status, grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(code, exc.message)
            raise  # not reached: abort raises

    async def _checked_model(self, request, context: grpc.aio.ServicerContext) -> generate_pb2.ModelInfo:
        await self._admit(context)
        info = await self._model_info(context, request)
        if checks.other_model(request.model, info):
            await context.abort(grpc.StatusCode.NOT_FOUND, _no_such_model(request.model))
        return info

    async def _forward(self, rpc, request, context: grpc.aio.ServicerContext):
        try:
            return await rpc(request, timeout=_timeout(context, RPC_TIMEOUT_S))
        except grpc.RpcError as exc:
            await context.abort(exc.code(), exc.details() or "")


def _timeout(context: grpc.aio.ServicerContext, default: float) -> float:
    remaining = context.time_remaining()
    return default if remaining is None else min(default, max(remaining, 0.0))

"""The public gRPC Generation service: the same stream the tokenizer service produces, behind the
gateway's API key and model check, with the gateway's receive stamp."""

from __future__ import annotations

import time
import uuid

import grpc

from pagedserve.v1 import generate_pb2, generate_pb2_grpc
from pagedserve.common.wire import params_from_proto
from pagedserve.gateway.backend import RPC_TIMEOUT_S, Backend

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_UNBOUNDED = 2**31 - 1


class GenerationService(generate_pb2_grpc.GenerationServicer):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def _check_key(self, context: grpc.aio.ServicerContext) -> None:
        metadata = {key.lower(): value for key, value in (context.invocation_metadata() or ())}
        if not self.backend.key_ok(metadata.get("authorization")):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong API key (metadata authorization: Bearer <key>)")

    async def _model_info(self, context: grpc.aio.ServicerContext) -> generate_pb2.ModelInfo:
        try:
            return await self.backend.model_info_rpc(_timeout(context, RPC_TIMEOUT_S))
        except grpc.RpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
            raise  # not reached: abort raises

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        received = time.time()
        if self.backend.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down")
        await self._check_key(context)
        info = await self._model_info(context)
        if request.model and request.model != info.model:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"the model {request.model!r} does not exist")
        if not info.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is loading")
        if request.WhichOneof("input") is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "one of prompt, prompt_token_ids or chat is required")
        try:
            params_from_proto(request.params, default_max_tokens=_UNBOUNDED)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        forward = generate_pb2.GenerateRequest()
        forward.CopyFrom(request)
        forward.request_id = request.request_id or "cmpl-" + uuid.uuid4().hex
        forward.timings.gateway_received = received
        n = request.params.n or 1
        tracker = self.backend.metrics.track(received)
        tracker.request_id = forward.request_id
        # The client's deadline goes downstream; its cancellation cancels this handler, whose
        # finally cancels the downstream call (the scheduler then aborts and frees the KV blocks).
        # context.write rather than yield: a generator suspended at a yield when the cancellation
        # lands would only run its finally whenever it is garbage-collected.
        call = self.backend.tokenizer.Generate(forward, timeout=context.time_remaining())
        finished = False
        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                tracker.on_message(msg)
                await context.write(msg)
            finished = True
        except grpc.RpcError as exc:
            finished = True
            await context.abort(exc.code(), exc.details() or "")
        finally:
            call.cancel()
            tracker.finish(n, cancelled=not finished)

    async def GetModelInfo(self, request: generate_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext):
        await self._check_key(context)
        return await self._model_info(context)


def _timeout(context: grpc.aio.ServicerContext, default: float) -> float:
    remaining = context.time_remaining()
    return default if remaining is None else min(default, max(remaining, 0.0))

"""The tokenizer's gRPC face: a thin grpc.aio servicer over TokenizerService, and the process
(`serve`). The request logic is in service.py and request_stream.py."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
import uvloop

from pagedserve.common.grpc_util import (SERVER_OPTIONS, MalformedRequestInterceptor, StatusError,
                                         add_health_and_reflection, add_internal_port, set_serving)
from pagedserve.common.local_call_server import LocalCallServer, Method
from pagedserve.common.sampling_defaults import read_defaults
from pagedserve.model_files.image_processing import image_config
from pagedserve.tokenizer.service import TokenizerService, load_tokenizer
from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

log = logging.getLogger("pagedserve.tokenizer")

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
# Call metadata of a resumable stream (the gateway's SSE streams): when the caller vanishes without
# aborting (its gateway died), the request keeps running this many seconds (at most
# MAX_RESUME_GRACE_S) so that a client can resume it from another gateway; a caller that means to
# end the request calls the scheduler's Abort first.
RESUME_GRACE_METADATA = "pagedserve-resume-grace"
MAX_RESUME_GRACE_S = 600.0


def resume_grace(context) -> float:
    try:
        for key, value in context.invocation_metadata() or ():
            if key == RESUME_GRACE_METADATA:
                return min(max(float(value), 0.0), MAX_RESUME_GRACE_S)
    except (TypeError, ValueError, AttributeError):
        pass
    return 0.0


class TokenizerServicer(generate_pb2_grpc.TokenizerServicer):
    """gRPC over TokenizerService; `service` is None while the tokenizer loads."""

    def __init__(self, service: TokenizerService | None = None) -> None:
        self.service = service
        self.local_socket = ""  # where Generate is also served without gRPC (common/local_calls.py)

    async def _service(self, context) -> TokenizerService:
        if self.service is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the tokenizer is still loading")
        return self.service

    async def Generate(self, request, context):
        service = await self._service(context)
        try:
            stream = await service.start(request, resume_grace(context))
            context.add_done_callback(lambda ctx: stream.caller_done(ctx.cancelled()))
            async for response in stream.responses():
                yield response
        except StatusError as exc:
            await context.abort(exc.code, exc.details)

    async def Tokenize(self, request, context):
        try:
            return await (await self._service(context)).tokenize(request)
        except StatusError as exc:
            await context.abort(exc.code, exc.details)

    async def Detokenize(self, request, context):
        try:
            return await (await self._service(context)).detokenize(request)
        except StatusError as exc:
            await context.abort(exc.code, exc.details)

    async def GetModelInfo(self, request, context):
        return await (await self._service(context)).model_info()

    async def GetLocalSocket(self, request, context):
        return common_pb2.LocalSocket(path=self.local_socket)


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
    # Generate also without gRPC, for a gateway on this host (common/local_calls.py).
    local = LocalCallServer({"Generate": Method(servicer.Generate, generate_pb2.GenerateRequest)}, "tokenizer")
    servicer.local_socket = await local.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("tokenizer listening on %s (loading the tokenizer)", address)
    loader = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, args.model, args.tokenizer,
                                                        getattr(args, "revision", None)))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([loader, stopper], return_when=asyncio.FIRST_COMPLETED)
    if not loader.done():
        loader.cancel()
        await asyncio.gather(server.stop(grace=None), local.stop())
        return 0
    try:
        tokenizer, default_name, vocab_size, folder = loader.result()
        defaults = read_defaults(folder, args.generation_config, args.override_generation_config)
        images = image_config(folder, tokenizer, args.mm_processor_kwargs)  # None: a text model
    except Exception as exc:
        log.error("could not load the tokenizer: %s", exc)
        await asyncio.gather(server.stop(grace=None), local.stop())
        return 1
    # Built here, not in the loader's thread: the scheduler channel belongs to this event loop.
    router = None
    local_links = args.service_transport == "auto"
    if args.redis_url and args.redis_url not in ("memory", "memory://"):
        from pagedserve.tokenizer.replica_router import ReplicaRouter
        router = ReplicaRouter(args.redis_url, args.redis_prefix, args.routing_policy, local_links)
    try:
        service = TokenizerService(tokenizer, args.served_model_name or [default_name], args.scheduler_addr,
                                   args.scheduler_retry_timeout, vocab_size, chat_template=args.chat_template,
                                   router=router, local_links=local_links, sampling_defaults=defaults,
                                   images=images)
    except ValueError as exc:  # --chat-template names no file
        log.error("%s", exc)
        await asyncio.gather(server.stop(grace=None), local.stop())
        return 1
    servicer.service = service
    set_serving(health, [SERVICE_NAME])
    if defaults:
        log.info("a request's unset sampling fields take the model's generation config: %s "
                 "(--generation-config vllm: the engine's defaults)", defaults)
    log.info("tokenizer serving %s on %s (%s)", service.served_model_name, address,
             f"engine replicas from the Redis registry, routing {args.routing_policy}" if router else
             f"scheduler at {args.scheduler_addr}")
    await stopper
    log.info("tokenizer shutting down")
    set_serving(health, [SERVICE_NAME], serving=False)
    await asyncio.gather(server.stop(grace=5.0), local.stop(grace=5.0))
    await service.close()
    return 0


def serve(args) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return uvloop.run(_serve(args))  # asyncio on libuv: less CPU per message than asyncio's own loop

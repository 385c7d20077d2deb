"""The scheduler's gRPC face: a thin grpc.aio servicer over SchedulerService."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading

import grpc
import uvloop

from pagedserve.common.gc_heap import freeze_startup_heap
from pagedserve.common.multimodal import image_to_proto
from pagedserve.common import wire
from pagedserve.common.grpc_util import (
    SERVER_OPTIONS,
    MalformedRequestInterceptor,
    add_internal_port,
    StatusError,
    add_health_and_reflection,
    set_serving,
)
from pagedserve.common.local_call_server import LocalCallServer, Method
from pagedserve.common.store import open_store
from pagedserve.v1 import common_pb2, generate_pb2, scheduler_pb2, scheduler_pb2_grpc
from pagedserve.scheduler.service import SchedulerService, ServiceConfig
from pagedserve.scheduler.subscriptions import DeltaFilter, Outbox, Subscription, accepted_message, error_message
from pagedserve.scheduler.worker_client import WorkerGroup

log = logging.getLogger("pagedserve.scheduler")
_COMMANDS_ENDED = object()  # an Outbox "subscription": the Stream's command reader is done
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name



# A step's deltas for one tokenizer go in one message up to this size, then in as many as they
# fill (a request's prompt logprobs can be megabytes: they must not hold back everyone's tokens
# behind one huge message, nor pass gRPC's message limit).
STEP_MESSAGE_BYTES = 1 << 20


def split_step_message(out: scheduler_pb2.StepDeltas, limit: int = STEP_MESSAGE_BYTES) -> list:
    """out as messages of about `limit` bytes or less (a larger delta alone), in order; the
    errors ride in the first."""
    if out.ByteSize() <= limit:
        return [out]
    parts, current, size = [], scheduler_pb2.StepDeltas(errors=out.errors), 0
    for delta in out.deltas:
        delta_size = delta.ByteSize()
        if current.deltas and size + delta_size > limit:
            parts.append(current)
            current, size = scheduler_pb2.StepDeltas(), 0
        current.deltas.append(delta)
        size += delta_size
    parts.append(current)
    return parts

class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Translates protobuf to SchedulerService calls; the delivery bookkeeping is in subscriptions.py."""

    def __init__(self, service: SchedulerService) -> None:
        self.service = service
        self.local_socket = ""  # where Stream is also served without gRPC (common/local_calls.py)

    async def Generate(self, request, context):
        outbox = Outbox(asyncio.get_running_loop())
        try:
            await self.service.check_grammar(request)
            sub, group = self.service.submit(request, outbox)
        except StatusError as exc:
            await context.abort(exc.code, exc.details)
        try:
            yield accepted_message(group)
            deltas = DeltaFilter.for_request(group.group_id, group.n, request.skip_tokens, sub.replayed,
                                            prompt_logprobs=request.params.HasField("prompt_logprobs"))
            while not deltas.done:
                for _, item in await outbox.next_batch():
                    if isinstance(item, StatusError):
                        await context.abort(item.code, item.details)
                    for msg in deltas.deltas(*item):
                        yield msg
        finally:
            self.service.unsubscribe(sub)

    async def Stream(self, request_iterator, context):
        """A tokenizer's requests, multiplexed: subscriptions come and go by command; every
        message down carries all of one step's deltas (and acceptances and errors) at once."""
        outbox = Outbox(asyncio.get_running_loop())
        live: dict[int, tuple[Subscription, DeltaFilter]] = {}
        commands = asyncio.ensure_future(self._read_commands(request_iterator, outbox, live))
        # The commands' end reaches the loop through the same outbox (after everything they
        # posted): one await per step, not a Task and an asyncio.wait.
        commands.add_done_callback(lambda task: outbox.post_here([(_COMMANDS_ENDED, task)]))
        try:
            while True:
                out = scheduler_pb2.StepDeltas()
                ended = None
                for sub, item in await outbox.next_batch():
                    if sub is _COMMANDS_ENDED:
                        ended = item
                        break
                    if sub is None:  # refused at submit
                        out.errors.append(item)
                        continue
                    entry = live.get(sub.tag)
                    if entry is None or entry[0] is not sub:
                        continue  # left already
                    if isinstance(item, scheduler_pb2.TokenDelta):  # accepted
                        out.deltas.append(item)
                    elif isinstance(item, StatusError):
                        out.errors.append(error_message(sub.tag, sub.group_id, item))
                        self._leave(live, sub.tag)
                    else:
                        deltas = entry[1].deltas(*item)
                        if deltas:
                            out.deltas.extend(deltas)
                        if entry[1].done:
                            self._leave(live, sub.tag)
                if out.deltas or out.errors:
                    for part in split_step_message(out):
                        yield part
                if ended is not None:
                    ended.result()  # the tokenizer closed its side (or the read failed): end
                    return
        finally:
            commands.cancel()
            for tag in list(live):
                self._leave(live, tag)

    async def _read_commands(self, request_iterator, outbox: Outbox, live: dict) -> None:
        async for command in request_iterator:
            kind = command.WhichOneof("command")
            if kind == "leave":
                self._leave(live, command.leave)
                continue
            if kind != "schedule":
                continue
            msg = command.schedule
            try:
                if msg.tag in live:
                    raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"tag {msg.tag} is already in use")
                await self.service.check_grammar(msg)
                sub, group = self.service.submit(msg, outbox, msg.tag)
            except StatusError as exc:
                outbox.post_here([(None, error_message(msg.tag, msg.request_id, exc))])
                continue
            except Exception as exc:  # noqa: BLE001 - one request's failure must not end the others' stream
                log.exception("request %r: submit failed", msg.request_id)
                error = StatusError(grpc.StatusCode.INTERNAL, f"the scheduler failed the request: {exc}")
                outbox.post_here([(None, error_message(msg.tag, msg.request_id, error))])
                continue
            live[msg.tag] = (sub, DeltaFilter.for_request(group.group_id, group.n, msg.skip_tokens, sub.replayed,
                                                          msg.tag, msg.params.HasField("prompt_logprobs")))
            # Before any delivery: those reach the outbox through call_soon_threadsafe, later.
            outbox.post_here([(sub, accepted_message(group, msg.tag))])

    def _leave(self, live: dict, tag: int) -> None:
        entry = live.pop(tag, None)
        if entry is not None:
            self.service.unsubscribe(entry[0])

    async def Abort(self, request, context):
        index = request.index if request.HasField("index") else None
        return scheduler_pb2.AbortResponse(found=self.service.abort(request.request_id, index))

    async def GetStats(self, request, context):
        return self.service.stats()

    async def GetRequest(self, request, context):
        record = await asyncio.to_thread(self.service.store.load, request.request_id)
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id!r} "
                                "(unknown, or its record expired)")
        msg = scheduler_pb2.RequestRecord(request_id=record.request_id, status=record.status,
                                          prompt_token_ids=record.prompt_token_ids,
                                          finish_reasons=record.finish_reasons, priority=record.priority)
        try:
            from pagedserve.common.sampling_params import SamplingParams
            wire.params_to_proto(SamplingParams(**record.params), msg.params)
        except (TypeError, ValueError):
            pass  # an old or foreign record: the rest is still worth answering with
        for tokens in record.outputs:
            msg.outputs.add(ids=tokens)
        for image in record.images:
            image_to_proto(image, msg.images.add())
        wire.timings_from_dict(record.timings, msg.timings)
        return msg

    async def GetEngineStats(self, request, context):
        try:
            return await self.service.engine_stats(request.max_steps or 256)
        except StatusError as exc:
            await context.abort(exc.code, exc.details)

    async def GetLocalSocket(self, request, context):
        return common_pb2.LocalSocket(path=self.local_socket)

    async def GetModelInfo(self, request, context):
        service = self.service
        info = service.info
        reply = generate_pb2.ModelInfo(model=service.model_name(), max_model_len=service.max_model_len,
                                       vocab_size=info.vocab_size if info else 0, ready=service.ready)
        if info:
            reply.max_logprobs = service.max_logprobs
        return reply


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """The scheduler's settings (pagedserve.common.settings, "scheduler") as a ServiceConfig: the
    fields of the same name as they are, the others renamed here."""
    values = vars(args)
    same = {name: values[name] for name in ServiceConfig.__dataclass_fields__ if name in values}
    return ServiceConfig(**{
        **same, "kv_cache_memory": args.kv_cache_memory or "", "policy": args.scheduling_policy,
        "enable_prefix_caching": not args.no_prefix_caching, "enable_chunked_prefill": not args.no_chunked_prefill,
        "async_scheduling": not args.no_async_scheduling, "log_stats": not args.disable_log_stats,
        "worker_timeout_s": args.worker_timeout, "orphan_timeout_s": args.orphan_timeout,
        "step_timeout_s": args.step_timeout, "stall_timeout_s": args.stall_timeout})


async def _serve(args: argparse.Namespace) -> int:
    replica_id = getattr(args, "replica_id", "") or ""
    store = open_store(args.redis_url, args.redis_prefix, args.redis_ttl, args.request_retention, replica_id)
    workers = WorkerGroup([a.strip() for a in args.worker_addrs.split(",") if a.strip()],
                          step_timeout_s=args.step_timeout, transport=args.worker_transport)
    service = SchedulerService(config_from_args(args), workers, store)
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[MalformedRequestInterceptor()])
    servicer = SchedulerServicer(service)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    address = f"{args.host}:{args.port}"
    if add_internal_port(server, address) == 0:
        raise ValueError(f"cannot bind the scheduler to {address}")
    await server.start()
    # The tokenizer's Stream also without gRPC, for a tokenizer on this host (common/local_calls.py).
    local = LocalCallServer({"Stream": Method(servicer.Stream, scheduler_pb2.StreamCommand, True)}, "scheduler")
    servicer.local_socket = await local.start()
    freeze_startup_heap()  # gRPC's, Redis' and our own modules: no full collection rescans them per step
    log.info("scheduler listening on %s; waiting for %d worker rank(s)", address, len(workers.addresses))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starting = loop.run_in_executor(None, service.start)
    done, _ = await asyncio.wait([starting, asyncio.ensure_future(stop.wait())],
                                 return_when=asyncio.FIRST_COMPLETED)
    if starting in done:
        starting.result()  # raise what failed at start-up
        heartbeat = await asyncio.to_thread(_start_heartbeat, args, service, store) if replica_id else None
        set_serving(health, [SERVICE_NAME])
        log.info("scheduler ready (model %s, max_model_len %d)", service.model_name(), service.max_model_len)
        watcher = asyncio.ensure_future(_watch_health(service, health))
        await stop.wait()
        watcher.cancel()
        if heartbeat is not None:
            await asyncio.to_thread(heartbeat.stop)  # out of routing before the streams close
    set_serving(health, [SERVICE_NAME], False)
    await asyncio.gather(server.stop(grace=2.0), local.stop(grace=2.0))
    await asyncio.to_thread(service.stop)
    return 0


def _start_heartbeat(args: argparse.Namespace, service: SchedulerService, store):
    """Register this engine replica in the Redis registry and keep it there (docs/scale-out.md)."""
    from pagedserve.common.replicas import ReplicaPublisher
    from pagedserve.scheduler.replica_heartbeat import Heartbeat
    host = args.host if args.host not in ("", "0.0.0.0", "::", "[::]") else "127.0.0.1"
    addr = args.advertise_addr or f"{host}:{args.port}"
    publisher = ReplicaPublisher(store.client, args.redis_prefix, args.replica_id, args.heartbeat_ttl,
                                 args.published_prefix_blocks)
    heartbeat = Heartbeat(service, publisher, addr, args.heartbeat_interval)
    heartbeat.beat()  # registered before anyone is told this scheduler is ready
    heartbeat.start()
    log.info("replica %s registered at %s (heartbeat every %g s, TTL %g s)", args.replica_id, addr,
             args.heartbeat_interval, args.heartbeat_ttl)
    return heartbeat


async def _watch_health(service: SchedulerService, health, interval_s: float = 0.25) -> None:
    """The gRPC health service follows the engine: NOT_SERVING while a worker rank is gone, the
    engine is stalled or the store is unreachable (the cause is in GetStats and the log)."""
    serving = True
    while True:
        await asyncio.sleep(interval_s)
        cause = service.unhealthy_cause()
        if bool(cause) == serving:
            serving = not cause
            set_serving(health, [SERVICE_NAME], serving)
            if cause:
                log.warning("health: NOT_SERVING (%s)", cause)
            else:
                log.info("health: SERVING again")


def serve(args: argparse.Namespace) -> int:
    threading.current_thread().name = "scheduler-main"
    return uvloop.run(_serve(args))  # asyncio on libuv: less CPU per message than asyncio's own loop



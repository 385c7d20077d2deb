"""The scheduler's gRPC face: a thin grpc.aio servicer over SchedulerService."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading

import grpc

from pagedserve.common import wire
from pagedserve.common.grpc_util import (
    SERVER_OPTIONS,
    MalformedRequestInterceptor,
    add_internal_port,
    StatusError,
    add_health_and_reflection,
    set_serving,
)
from pagedserve.common.store import open_store
from pagedserve.v1 import generate_pb2, scheduler_pb2, scheduler_pb2_grpc
from pagedserve.scheduler.records import Delivery
from pagedserve.scheduler.service import SchedulerService, ServiceConfig
from pagedserve.scheduler.worker_client import WorkerGroup

log = logging.getLogger("pagedserve.scheduler")
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


def delta_message(request_id: str, delivery: Delivery, tokens: list[int], logprobs) -> scheduler_pb2.TokenDelta:
    msg = scheduler_pb2.TokenDelta(request_id=request_id, index=delivery.index, token_ids=tokens,
                                   finish_reason=delivery.finish_reason,
                                   num_cached_tokens=delivery.num_cached_tokens)
    if logprobs:
        for token in logprobs:
            wire.token_to_proto(token, msg.logprobs.add())
    if delivery.timings:
        wire.timings_from_dict(delivery.timings, msg.timings)
    return msg


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, service: SchedulerService) -> None:
        self.service = service

    async def Generate(self, request, context):
        try:
            sub, group = self.service.submit(request, asyncio.get_running_loop())
        except StatusError as exc:
            await context.abort(exc.code, exc.details)
        try:
            accepted = scheduler_pb2.TokenDelta(request_id=group.group_id, accepted=True, n=group.n,
                                                num_prompt_tokens=len(group.prompt_token_ids))
            wire.timings_from_dict(group.timings, accepted.timings)
            yield accepted
            # Offsets make a replay and the live deltas after it line up with no token twice.
            sent = list(request.skip_tokens) + [0] * max(0, group.n - len(request.skip_tokens))
            finished = [False] * group.n
            replayed = sub.replayed
            while not all(finished):
                item = await sub.queue.get()
                if isinstance(item, StatusError):
                    await context.abort(item.code, item.details)
                is_replay, deliveries = item
                replayed |= is_replay
                if not replayed:
                    continue
                for delivery in deliveries:
                    index = delivery.index
                    if index >= group.n or finished[index]:
                        continue
                    skip = max(0, sent[index] - delivery.start)
                    tokens = delivery.token_ids[skip:]
                    logprobs = delivery.logprobs[skip:] if delivery.logprobs else None
                    sent[index] += len(tokens)
                    if tokens or delivery.finish_reason:
                        yield delta_message(group.group_id, delivery, tokens, logprobs)
                    finished[index] = bool(delivery.finish_reason)
        finally:
            self.service.unsubscribe(sub)

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
        wire.timings_from_dict(record.timings, msg.timings)
        return msg

    async def GetEngineStats(self, request, context):
        try:
            return await self.service.engine_stats(request.max_steps or 256)
        except StatusError as exc:
            await context.abort(exc.code, exc.details)

    async def GetModelInfo(self, request, context):
        service = self.service
        info = service.info
        return generate_pb2.ModelInfo(model=service.model_name(), max_model_len=service.max_model_len,
                                      vocab_size=info.vocab_size if info else 0, ready=service.ready)


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """The scheduler's settings (pagedserve.common.settings, "scheduler") as a ServiceConfig: the
    fields of the same name as they are, the others renamed here."""
    values = vars(args)
    same = {name: values[name] for name in ServiceConfig.__dataclass_fields__ if name in values}
    return ServiceConfig(**{
        **same, "kv_cache_memory": args.kv_cache_memory or "", "policy": args.scheduling_policy,
        "enable_prefix_caching": not args.no_prefix_caching, "enable_chunked_prefill": not args.no_chunked_prefill,
        "worker_timeout_s": args.worker_timeout, "orphan_timeout_s": args.orphan_timeout,
        "step_timeout_s": args.step_timeout, "stall_timeout_s": args.stall_timeout})


async def _serve(args: argparse.Namespace) -> int:
    store = open_store(args.redis_url, args.redis_prefix, args.redis_ttl)
    workers = WorkerGroup([a.strip() for a in args.worker_addrs.split(",") if a.strip()],
                          step_timeout_s=args.step_timeout)
    service = SchedulerService(config_from_args(args), workers, store)
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[MalformedRequestInterceptor()])
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(service), server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    address = f"{args.host}:{args.port}"
    if add_internal_port(server, address) == 0:
        raise ValueError(f"cannot bind the scheduler to {address}")
    await server.start()
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
        set_serving(health, [SERVICE_NAME])
        log.info("scheduler ready (model %s, max_model_len %d)", service.model_name(), service.max_model_len)
        watcher = asyncio.ensure_future(_watch_health(service, health))
        await stop.wait()
        watcher.cancel()
    set_serving(health, [SERVICE_NAME], False)
    await server.stop(grace=2.0)
    await asyncio.to_thread(service.stop)
    return 0


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
    return asyncio.run(_serve(args))



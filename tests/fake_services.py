"""Fake tokenizer and scheduler services, whose behaviour each prompt selects, and the real gateway
in front of them in this process (uvicorn and its public gRPC API): the Stack of
tests/test_gateway_app.py and tests/test_gateway_admission.py."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures

import grpc
import uvicorn

from pagedserve.common.grpc_util import free_port
from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from pagedserve.gateway.app import build_app
from pagedserve.gateway.backend import Backend
from pagedserve.gateway.grpc_api import GenerationService
from pagedserve.gateway.limits import Limits

MODEL = "fake-model"
ALIAS = "fake-alias"  # --served-model-name's second name
KEY = "sekret"


class FakeTokenizer(generate_pb2_grpc.TokenizerServicer):
    def __init__(self) -> None:
        self.requests: list[generate_pb2.GenerateRequest] = []
        self.cancelled = threading.Event()
        self.ready = True
        self.model_info_calls = 0
        self.takes_images = False

    def GetModelInfo(self, request, context):
        self.model_info_calls += 1
        return generate_pb2.ModelInfo(model=MODEL, aliases=[ALIAS], max_model_len=128, vocab_size=100,
                                      ready=self.ready, takes_images=self.takes_images)

    def Generate(self, request, context):
        self.requests.append(request)
        prompt = request.prompt or (request.chat.messages[-1].content if request.chat.messages else "")
        failures = {"full": (grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue is full"),
                    "toolong": (grpc.StatusCode.INVALID_ARGUMENT, "the prompt (300 tokens) exceeds the context"),
                    "loading": (grpc.StatusCode.UNAVAILABLE, "scheduler not ready")}
        if prompt in failures:
            context.abort(*failures[prompt])
        yield generate_pb2.GenerateResponse(request_id=request.request_id, accepted=True,
                                            usage=common_pb2.Usage(prompt_tokens=3),
                                            prompt_text=prompt if request.echo else "")
        if prompt == "slow":
            yield generate_pb2.GenerateResponse(request_id=request.request_id, text="tick", token_ids=[1])
            deadline = time.time() + 30
            while context.is_active() and time.time() < deadline:
                time.sleep(0.02)
            if not context.is_active():
                self.cancelled.set()
            return
        if prompt == "crash":
            context.abort(grpc.StatusCode.INTERNAL, "worker died")
        with_lp = request.params.HasField("logprobs")
        for index in range(request.params.n or 1):
            for k, word in enumerate(["Hello", " world"]):
                last = k == 1
                msg = generate_pb2.GenerateResponse(request_id=request.request_id, index=index, text=word,
                                                    token_ids=[10 + k])
                if with_lp:
                    msg.logprobs.add(token_id=10 + k, logprob=-0.5, token=word,
                                     top=[common_pb2.TopLogprob(token_id=10 + k, logprob=-0.5, token=word)])
                if last:
                    msg.finish_reason = "length"
                    msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=3, completion_tokens=2))
                    t = request.timings
                    msg.timings.CopyFrom(common_pb2.Timings(
                        gateway_received=t.gateway_received, tokenizer_received=t.gateway_received + 0.001,
                        tokenized=t.gateway_received + 0.002, scheduler_received=t.gateway_received + 0.003,
                        first_scheduled=t.gateway_received + 0.004, first_token=t.gateway_received + 0.005,
                        finished=t.gateway_received + 0.006, worker_time_s=0.002))
                yield msg


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    stats_calls = 0

    def GetStats(self, request, context):
        self.stats_calls += 1
        return scheduler_pb2.SchedulerStats(num_running=2, num_waiting=1, num_gpu_blocks=100, num_free_gpu_blocks=75,
                                            prefix_cache_queries=10, prefix_cache_hits=4, ready=True)

    def GetEngineStats(self, request, context):
        return scheduler_pb2.EngineStats(ready=True, num_blocks=100, block_states="u" * 25 + "." * 75)

    def GetRequest(self, request, context):
        if not request.request_id.endswith(".known"):  # the gateway asks by internal id: owner.client id
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown request")
        return scheduler_pb2.RequestRecord(
            request_id="known", status="finished", prompt_token_ids=[1, 2, 3],
            outputs=[generate_pb2.TokenIds(ids=[4, 5])], finish_reasons=["stop"],
            timings=common_pb2.Timings(gateway_received=100.0, tokenizer_received=100.5, tokenized=101.0,
                                       scheduler_received=101.0, first_scheduled=102.0, first_token=103.0,
                                       finished=104.0))


class Stack:
    """Fakes on a thread-pool gRPC server; the gateway (uvicorn + grpc.aio) on its own loop thread."""

    def __init__(self, limits: Limits | None = None, takes_images: bool = False) -> None:
        self.tokenizer, self.scheduler = FakeTokenizer(), FakeScheduler()
        self.tokenizer.takes_images = takes_images
        self.fakes = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        generate_pb2_grpc.add_TokenizerServicer_to_server(self.tokenizer, self.fakes)
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.scheduler, self.fakes)
        fake_port = self.fakes.add_insecure_port("127.0.0.1:0")
        self.fakes.start()
        self.port, self.grpc_port = free_port(), free_port()
        self.backend = Backend(f"127.0.0.1:{fake_port}", f"127.0.0.1:{fake_port}", api_key=KEY, limits=limits)
        self.http = uvicorn.Server(uvicorn.Config(build_app(self.backend), host="127.0.0.1", port=self.port,
                                                  log_level="warning"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)
        self.thread.start()
        deadline = time.time() + 10
        while not self.http.started:
            assert time.time() < deadline, "gateway did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _main(self) -> None:
        server = grpc.aio.server()
        generate_pb2_grpc.add_GenerationServicer_to_server(GenerationService(self.backend), server)
        server.add_insecure_port(f"127.0.0.1:{self.grpc_port}")
        await server.start()
        await self.http.serve()
        await server.stop(0)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(setattr, self.http, "should_exit", True)
        self.thread.join(10)
        self.fakes.stop(0)

"""The worker service: the model runner behind the Worker gRPC API.

A thin servicer over WorkerService, a plain class that tests drive directly. The scheduler calls
Describe, Profile and InitCache once per session, then keeps one Step stream open and sends one
StepRequest per engine step; the worker applies the delta to the request state it caches and
answers with the sampled tokens (rank 0) or an empty acknowledgement (other ranks), in step order.
The scheduler may send a step before the last one's answer (async scheduling): the worker appends
its own samples, so the next step's decode tokens are in its state when that step starts.

The same steps can come over the local step link instead (step_socket.py: a Unix socket named in
Describe's step_socket), which a scheduler on this host uses: no gRPC thread between it and the
torch thread.

Threads: every torch call runs on one thread (torch_thread); a Step stream's reader thread queues
its steps there as they arrive, the gRPC thread of the stream sends the answers in order; a local
step link's connection is read and answered on the torch thread itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from pagedserve.common import wire
from pagedserve.common.compilation import with_flags
from pagedserve.common.gc_heap import freeze_startup_heap
from pagedserve.common.grpc_util import SERVER_OPTIONS, add_health_and_reflection, add_internal_port, set_serving
from pagedserve.v1 import worker_pb2, worker_pb2_grpc
from pagedserve.worker.step_errors import SessionMismatch, step_failure
from pagedserve.worker.step_socket import StepSocket
from pagedserve.worker.step_stream import StepPump

if TYPE_CHECKING:  # model_setup imports torch: not before main has set the OpenMP environment
    from pagedserve.worker.model_setup import KVSettings, KVSize

log = logging.getLogger("pagedserve.worker")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class WorkerService:
    """Loads the model; owns the KV pool and the per-request state between steps.

    At load it also sizes the KV pool its own settings (kv) ask for, so that a budget that holds
    no block fails the worker's startup, naming its numbers, before a scheduler waits on it; the
    memory reading taken then serves the scheduler's Profile, unless that asks for another step
    size."""

    def __init__(self, model: str | None, device: str = "auto", dtype: str = "auto",
                 max_model_len: int | None = None, rank: int = 0, world_size: int = 1,
                 dist_init_method: str | None = None, tokenizer: str | None = None,
                 quantization: str = "auto", kv: KVSettings | None = None, max_num_seqs: int | None = None,
                 enforce_eager: bool = False, lora: tuple[int, int, int] | None = None,
                 speculative_config: str | None = None, compilation_config: str | dict | None = None,
                 seed: int | None = None, revision: str | None = None,
                 mm_processor_kwargs: str | dict | None = None) -> None:
        import dataclasses

        import torch  # noqa: F401 - the worker is the one service that needs it

        from pagedserve.common.compilation import graph_plan
        from pagedserve.common.settings import defaults, step_budgets
        from pagedserve.common.speculative import parse_speculative_config
        from pagedserve.model_files.draft_check import check_draft_model
        from pagedserve.worker.device_memory import local_rank
        from pagedserve.worker.model_setup import KVSettings, place_model

        self.graphs = graph_plan(compilation_config, enforce_eager)  # which steps replay CUDA graphs
        self.seed = seed  # --seed: the generators start from it once the model is loaded

        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"--rank {rank} is outside a tensor-parallel group of size {world_size}")
        self.rank, self.world_size = rank, world_size
        self.dist_init_method = dist_init_method
        self.quantization = quantization
        # the eos ids of config.json and generation_config.json apply without a tokenizer too
        self.place = place_model(model, device, dtype, max_model_len, local_rank(rank, os.environ),
                                 tokenizer_name=tokenizer, need_tokenizer=False, revision=revision,
                                 mm_processor_kwargs=mm_processor_kwargs)
        self.model_path, self.model_config = self.place.model_path, self.place.model_config
        self.device, self.dtype = self.place.device, self.place.dtype
        self.max_model_len, self.eos_token_ids = self.place.max_model_len, self.place.eos_token_ids
        # --speculative-config's draft model (the scheduler's flag too): checked before anything loads
        self.draft_path = check_draft_model(parse_speculative_config(speculative_config), self.model_config,
                                            self.max_model_len)
        if kv is None:
            engine = defaults("engine")
            kv = KVSettings(engine["block_size"], engine["kv_cache_memory"], engine["gpu_memory_utilization"],
                            engine["max_num_batched_tokens"])
        # the largest step by the device's default (settings.step_budgets) when none is set
        # decode steps of up to this many sequences replay CUDA graphs (self.graphs; the CPU: never)
        self.max_num_seqs = max_num_seqs or defaults("engine")["max_num_seqs"]
        budget = step_budgets(kv.max_num_batched_tokens, None, self.device.type)[0]
        # the KV budget reserves the graphs' pool (size_kv_cache)
        self.kv = dataclasses.replace(kv, max_num_batched_tokens=budget,
                                      graph_tokens=self.graphs.graph_tokens(self.max_num_seqs, budget))
        self.kv_size: KVSize | None = None  # sized at load
        self.lora = lora  # (max_loras, max_lora_rank, max_cpu_loras) with --enable-lora
        self.runner = None
        self.session_id = ""
        self.lock = threading.Lock()  # one step at a time, and no InitCache in the middle of one
        # Every torch call runs on this one thread. libgomp gives each thread that starts an OpenMP
        # region a pool of its own, and once it manages more threads than there are cores it stops
        # spinning between regions (its "throttled" spin count), whatever the wait policy says: with
        # the model loaded on the main thread, profiled on one gRPC thread and stepped on another,
        # every parallel region of a step woke a sleeping thread, and W64 at concurrency 32 ran at
        # ~0.8x the in-process engine (docs/performance.md).
        self.torch_thread = futures.ThreadPoolExecutor(1, thread_name_prefix="worker-torch")
        self.step_socket = ""  # the local step link's path (step_socket.py), once serve() opens it

    def _on_torch_thread(self, fn, *args):
        return self.torch_thread.submit(fn, *args).result()

    def load(self) -> None:
        """Join the group, load the model and size the KV pool this worker's settings ask for
        (KVBudgetError, a ValueError naming the numbers, when it holds no block)."""
        self._on_torch_thread(self._load)

    def _load(self) -> None:
        from pagedserve.worker.model_setup import load_runner, seed_rngs, size_kv_cache
        from pagedserve.worker.process_group import init_tensor_parallel
        started = time.monotonic()
        # Every rank blocks here until all have joined the group, then loads only its shard.
        init_tensor_parallel(self.rank, self.world_size, self.dist_init_method, self.device)
        self.runner = load_runner(self.place, self.kv.block_size, self.quantization, progress=False)
        if self.lora is not None:  # its slots before the memory reading
            self.runner.enable_lora(*self.lora)
        if self.draft_path is not None:  # rank 0's draft model, before the KV pool is sized
            self.runner.enable_draft(self.draft_path)
        log.info("rank %d loaded %s (%s on %s; linear weights %s) in %.1f s", self.rank, Path(self.model_path).name,
                 str(self.dtype).removeprefix("torch."), self.device, self.runner.weights_description,
                 time.monotonic() - started)
        # On CUDA every rank profiles its largest step here at once (the step's collectives need all).
        self.kv_size = size_kv_cache(self.runner, self.kv)
        seed_rngs(self.seed)
        log.info("rank %d: a KV pool of %d blocks of %d tokens fits (%d bytes each)", self.rank,
                 self.kv_size.num_blocks, self.kv.block_size, self.kv_size.block_bytes)

    def describe(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            rank=self.rank, world_size=self.world_size, model=str(self.model_path),
            dtype=str(self.dtype).removeprefix("torch."), device=str(self.device), max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size, eos_token_ids=list(self.eos_token_ids),
            weight_bytes=0 if self.runner is None else self.runner.weight_bytes(), step_socket=self.step_socket,
            whole_images=bool((self.model_config.vision or {}).get("bidirectional")))

    def profile(self, request: worker_pb2.ProfileRequest) -> worker_pb2.ProfileResponse:
        return self._on_torch_thread(self._profile, request)

    def _profile(self, request: worker_pb2.ProfileRequest) -> worker_pb2.ProfileResponse:
        from pagedserve.worker.model_setup import size_kv_cache
        kv = profile_settings(request, self.kv)
        reading = self.kv_size.reading if self.kv_size is not None else None
        if reading is not None and kv.max_num_batched_tokens != self.kv.max_num_batched_tokens:
            reading = None  # another step size: measure again, without the pool of an earlier session
            with self.lock:
                self.runner.kv = None
                self.runner.forget_requests()
        size = size_kv_cache(self.runner, kv, reading)
        return worker_pb2.ProfileResponse(num_gpu_blocks=size.num_blocks, num_cpu_blocks=size.num_host_blocks,
                                          bytes_per_block=size.block_bytes,
                                          kv_group_windows=self.model_config.kv_groups().windows)

    def init_cache(self, request: worker_pb2.InitCacheRequest) -> None:
        self._on_torch_thread(self._init_cache, request)

    def _init_cache(self, request: worker_pb2.InitCacheRequest) -> None:
        with self.lock:
            if request.block_size:
                self.runner.block_size = request.block_size
            self.runner.kv = None  # free the old pool before the new one is allocated
            self.runner.forget_requests()
            self.runner.allocate_kv_cache(request.num_gpu_blocks, request.num_cpu_blocks)
            self.runner.use_decode_graphs(self.max_num_seqs, not self.graphs.decode,
                                          self.kv.max_num_batched_tokens if self.graphs.mixed else 0, self.graphs)
            self.session_id = request.session_id
        log.info("session %s: KV pool of %d blocks of %d tokens (%d host blocks)", request.session_id or "-",
                 request.num_gpu_blocks, self.runner.block_size, request.num_cpu_blocks)

    def step(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResult:
        return self.submit_step(request).result()

    def submit_step(self, request: worker_pb2.StepRequest) -> futures.Future:
        """Queue a step on the torch thread: steps run in the order submitted, back to back."""
        return self.torch_thread.submit(self.run_step, request)

    def run_step(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResult:
        """On the torch thread: apply one step's delta, run it, and answer."""
        return self.finish_step(self.begin_step(request))

    def begin_step(self, request: worker_pb2.StepRequest) -> BegunStep:
        """On the torch thread: apply one step's delta and launch it (ModelRunner.begin); finish_step
        answers it. A step begun before the last one is finished reads that one's sampled ids on the
        device (worker/step_overlap.py): the local step link does so when the next step is already there."""
        received = time.perf_counter()  # the worker's own time starts when the step does
        with self.lock:
            if request.session_id != self.session_id:
                raise SessionMismatch(f"step {request.step_id} belongs to scheduler session {request.session_id!r}, "
                                      f"but the KV pool was set up for {self.session_id!r}; call InitCache first")
            if self.runner.kv is None:
                raise SessionMismatch("no KV pool: call InitCache before Step")
            return BegunStep(request.step_id, self.runner.begin(wire.step_from_proto(request)), received)

    def finish_step(self, begun: BegunStep) -> worker_pb2.StepResult:
        """On the torch thread: the begun step's answer (its tokens taken on rank 0)."""
        with self.lock:
            result = self.runner.finish(begun.handle)
        if self.rank != 0:
            return worker_pb2.StepResult(step_id=begun.step_id, worker_time_s=time.perf_counter() - begun.received)
        return wire.result_to_proto(result, time.perf_counter() - begun.received)


@dataclass(slots=True)
class BegunStep:
    step_id: int
    handle: object  # the model runner's step_overlap.StepInFlight
    received: float  # perf_counter when the worker took it up

    def ready(self) -> bool:
        """Whether the device has finished it (finishing it now would not wait)."""
        return self.handle.ready()


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, service: WorkerService, ready: threading.Event) -> None:
        self.service, self.ready = service, ready

    def _check_ready(self, context) -> None:
        if not self.ready.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading the model")

    def Describe(self, request, context):
        return self.service.describe()

    def Profile(self, request, context):
        self._check_ready(context)
        try:
            return self.service.profile(request)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def InitCache(self, request, context):
        self._check_ready(context)
        if request.num_gpu_blocks < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_gpu_blocks must be >= 1")
        try:
            self.service.init_cache(request)
        except (RuntimeError, ValueError) as exc:  # e.g. out of memory for the pool
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot allocate the KV pool: {exc}")
        return worker_pb2.InitCacheResponse()

    def Step(self, request_iterator, context):
        """Steps begin on the torch thread as they arrive; one the scheduler sent ahead (async scheduling)
        that arrives while the device still runs the one before begins first, reading that one's tokens on
        the device, and each is answered as soon as the device is done with it (worker/step_stream.py: the
        local step link's rule over gRPC, for ranks on another host)."""
        self._check_ready(context)
        pump = StepPump(self.service)
        threading.Thread(target=pump.read, args=(request_iterator,), name="step-reader", daemon=True).start()
        while (reply := pump.replies.get()) is not None:
            if isinstance(reply, BaseException):
                failure = step_failure(reply)
                if failure is None:
                    raise reply
                context.abort(grpc.StatusCode[failure[0]], failure[1])
            yield reply


def profile_settings(request: worker_pb2.ProfileRequest, own: KVSettings) -> KVSettings:
    """The KV settings a scheduler's Profile asks for; a field it leaves unset keeps the worker's."""
    from pagedserve.worker.model_setup import KVSettings
    # (the graphs are the worker's own: InitCache captures them at its own step budget)
    return KVSettings(request.block_size or own.block_size, request.kv_cache_memory or own.kv_cache_memory,
                      request.gpu_memory_utilization or own.gpu_memory_utilization,
                      request.max_num_batched_tokens or own.max_num_batched_tokens, request.swap_space or 0,
                      own.graph_tokens)


def kv_settings(args: argparse.Namespace) -> KVSettings:
    """The worker's own KV settings: the flags its scheduler takes too (the launcher hands both the
    same values); an unset step budget is the device's default (WorkerService)."""
    from pagedserve.worker.model_setup import KVSettings
    return KVSettings(args.block_size, args.kv_cache_memory, args.gpu_memory_utilization, args.max_num_batched_tokens)


def dist_init_method(address: str | None) -> str | None:
    """host:port of rank 0's rendezvous, else MASTER_ADDR/MASTER_PORT from the environment."""
    if address:
        return f"tcp://{address}"
    return "env://" if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT") else None


def serve(args: argparse.Namespace) -> int:
    service = WorkerService(args.model, args.device, args.dtype, args.max_model_len, args.rank,
                            args.tensor_parallel_size, dist_init_method(args.dist_init_addr), args.tokenizer,
                            args.quantization, kv_settings(args), args.max_num_seqs, args.enforce_eager,
                            (args.max_loras, args.max_lora_rank, args.max_cpu_loras or args.max_loras)
                            if args.enable_lora else None, args.speculative_config,
                            with_flags(args.compilation_config, args.cudagraph_capture_sizes,
                                       args.max_cudagraph_capture_size, args.cuda_graph_sizes),
                            args.seed, args.revision, args.mm_processor_kwargs)
    ready = threading.Event()
    # A few threads: one long-lived Step stream plus the unary calls and health checks beside it.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=SERVER_OPTIONS)
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(service, ready), server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    address = f"{args.host}:{args.port}"
    if add_internal_port(server, address) == 0:
        raise ValueError(f"cannot bind the worker to {address}")
    server.start()
    log.info("worker rank %d listening on %s, loading the model", args.rank, address)
    service.load()
    step_socket = open_step_socket(service)
    freeze_startup_heap()  # the model and libraries: no full collection rescans them between steps
    ready.set()
    set_serving(health, [SERVICE_NAME])
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    set_serving(health, [SERVICE_NAME], False)
    if step_socket is not None:
        step_socket.close()
    server.stop(grace=2.0).wait()
    return 0


def open_step_socket(service: WorkerService):
    """The local step link (a StepSocket), advertised in Describe; None (steps come over gRPC)
    where no Unix socket can be made."""
    try:
        step_socket = StepSocket(service)
    except OSError as exc:
        log.warning("no local step link (%s): steps come over the gRPC Step stream only", exc)
        return None
    service.step_socket = step_socket.path
    return step_socket

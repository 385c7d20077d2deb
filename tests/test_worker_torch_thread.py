"""The worker service does all its torch work on one thread, whichever gRPC thread calls it.

libgomp gives every thread that starts an OpenMP region a thread pool of its own, and once it
manages more threads than there are cores it stops spinning between regions whatever the wait
policy says: with the model loaded on the main thread and profiled and stepped on gRPC threads,
every parallel region of a step woke a sleeping thread (docs/performance.md)."""

import threading

from pagedserve.v1 import worker_pb2
from pagedserve.worker.server import WorkerService


class ThreadRecordingService(WorkerService):
    """The real service; each torch-side method notes the thread it ran on."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.threads: dict[str, int] = {}

    def _load(self):
        self.threads["load"] = threading.get_ident()
        return super()._load()

    def _profile(self, request):
        self.threads["profile"] = threading.get_ident()
        return super()._profile(request)

    def _init_cache(self, request):
        self.threads["init_cache"] = threading.get_ident()
        return super()._init_cache(request)

    def run_step(self, request):
        self.threads["step"] = threading.get_ident()
        return super().run_step(request)


def call_from_a_thread_of_its_own(fn, *args):
    out, caller = [], []
    thread = threading.Thread(target=lambda: (caller.append(threading.get_ident()), out.append(fn(*args))))
    thread.start()
    thread.join()
    return out[0], caller[0]


def test_load_profile_init_and_step_run_on_one_thread(tiny_llama):
    service = ThreadRecordingService(str(tiny_llama), device="cpu", dtype="float32", quantization="none")
    try:
        service.load()  # from this (the main) thread, as serve() does
        sizes, profile_caller = call_from_a_thread_of_its_own(
            service.profile, worker_pb2.ProfileRequest(block_size=16, kv_cache_memory=str(1 << 20),
                                                       max_num_batched_tokens=32))
        _, init_caller = call_from_a_thread_of_its_own(
            service.init_cache, worker_pb2.InitCacheRequest(num_gpu_blocks=sizes.num_gpu_blocks, block_size=16,
                                                           session_id="s"))
        result, step_caller = call_from_a_thread_of_its_own(
            service.step, worker_pb2.StepRequest(step_id=1, session_id="s"))
        assert result.step_id == 1
        assert set(service.threads) == {"load", "profile", "init_cache", "step"}
        assert len(set(service.threads.values())) == 1
        callers = {threading.get_ident(), profile_caller, init_caller, step_caller}
        assert service.threads["step"] not in callers
    finally:
        service.torch_thread.shutdown()

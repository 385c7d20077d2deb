"""Where an engine step's time goes, per step kind: `pagedserve bench throughput --profile`.

A StepProfiler wraps a few hook points of one ModelRunner (and its model's ops bundle's `linear`) with
timers while it is installed, and puts them back on `remove()`; the serving path never pays for it.
Parts: weight matmuls (every `linear` call, the LM head apart), attention (the backend's forward,
KV write included), sampler, metadata (the runner's `_prepare`: the step's layout from the delta),
the rest of the model (embedding, norms, rotary, activation, residuals and its Python) and the
rest of the runner (applying the delta, bookkeeping). Each part is set against a floor: matmul
FLOPs at the machine's measured matmul rate in the serving dtype, weight bytes at the measured
memory bandwidth. On CUDA every timer synchronises, which slows the run but keeps the split true.

Threads: the engine's own (single) thread; not thread-safe, not for the services' processes.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

PARTS = ("matmul", "lm_head", "attention", "sampler", "metadata", "model other", "runner other")
KINDS = ("prefill", "mixed", "decode 1", "decode 2-8", "decode 9-32", "decode 33-64", "decode 65+")


def step_kind(num_scheduled_tokens: dict[str, int]) -> str:
    counts = list(num_scheduled_tokens.values())
    decodes = sum(1 for n in counts if n == 1)
    if decodes == len(counts):
        for limit, name in ((1, "decode 1"), (8, "decode 2-8"), (32, "decode 9-32"), (64, "decode 33-64")):
            if decodes <= limit:
                return name
        return "decode 65+"
    return "prefill" if decodes == 0 else "mixed"


@dataclass(slots=True)
class KindStats:
    steps: int = 0
    tokens: int = 0
    flops: float = 0.0  # matmul FLOPs (LM head included)
    weight_bytes: float = 0.0  # weight bytes the matmuls read (each call streams its weight once)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))


def measure_rates(dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """(matmul FLOP/s in dtype, memory bytes/s): the best of a few runs of a [512, 1024] x
    [1024, 4096] matmul and of a 256 MiB copy."""
    a = torch.randn(512, 1024, dtype=dtype, device=device)
    b = torch.randn(1024, 4096, dtype=dtype, device=device)
    src = torch.empty(64 * 2**20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def best(fn, repeats: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t)
        return min(times)

    mm_rate = 2 * 512 * 1024 * 4096 / best(lambda: torch.mm(a, b), 10)
    bandwidth = 2 * src.numel() * 4 / best(lambda: dst.copy_(src), 5)  # read + write
    return mm_rate, bandwidth


def _weight_size(layer) -> tuple[int, int]:
    """(elements, bytes a matmul reads) of a layer's weight: a quantized layer's float `weight` is
    an empty placeholder, its blocks are in `quant`."""
    quant = getattr(layer, "quant", None)
    if quant is not None:
        return sum(quant.row_counts) * quant.cols, quant.nbytes
    return layer.weight.numel(), layer.weight.numel() * layer.weight.element_size()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepProfiler:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.device = runner.device
        self.kinds: dict[str, KindStats] = defaultdict(KindStats)
        self._current: KindStats | None = None
        self._undo: list[tuple[object, str, object, bool]] = []
        self.mm_rate, self.bandwidth = measure_rates(runner.dtype, runner.device)

    # ---- hooks ---------------------------------------------------------------------------
    def _patch(self, owner, name: str, wrapper) -> None:
        # (owner, name, what was there, whether the owner itself held it or its class did)
        self._undo.append((owner, name, getattr(owner, name), name in vars(owner)))
        setattr(owner, name, wrapper)

    @contextmanager
    def _timed(self, part: str):
        _sync(self.device)
        t = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            if self._current is not None:
                self._current.seconds[part] += time.perf_counter() - t

    def install(self) -> StepProfiler:
        runner, model = self.runner, self.runner.model
        ops = model.ops  # the model's ops bundle (shared by its layers, and by other models on this device)
        original_linear = ops.linear

        def linear(x, layer):
            stats = self._current
            if stats is not None:
                elements, nbytes = _weight_size(layer)
                stats.flops += 2.0 * x.shape[0] * elements
                stats.weight_bytes += nbytes
            with self._timed("matmul"):
                return original_linear(x, layer)

        self._patch(ops, "linear", linear)

        def compute_logits(hidden, _original=model.compute_logits):
            stats = self._current
            if stats is not None:
                elements, nbytes = _weight_size(model.lm_head or model.embed_tokens)
                stats.flops += 2.0 * hidden.shape[0] * elements
                stats.weight_bytes += nbytes
            with self._timed("lm_head"):
                return _original(hidden)

        self._patch(model, "compute_logits", compute_logits)
        self._wrap(model, "forward", None)  # the model's whole forward: "model other" is what is left
        backends = {id(m.backend): m.backend for m in model.modules() if hasattr(m, "backend")}
        for backend in backends.values():
            self._wrap(backend, "forward", "attention")
        self._wrap(runner, "_prepare", "metadata")
        self._wrap(runner.sampling, "sample", "sampler")

        def execute(step, _original=runner.execute):  # (begin + finish: the engine runs steps one by one)
            if not step.num_scheduled_tokens:
                return _original(step)
            stats = self._current = self.kinds[step_kind(step.num_scheduled_tokens)]
            stats.steps += 1
            stats.tokens += step.total_num_scheduled_tokens
            t = time.perf_counter()
            try:
                return _original(step)
            finally:
                _sync(self.device)
                stats.seconds["total"] += time.perf_counter() - t
                self._current = None

        self._patch(runner, "execute", execute)
        return self

    def _wrap(self, owner, name: str, part: str | None) -> None:
        original = getattr(owner, name)
        part = part or "model"

        def wrapper(*args, **kwargs):
            with self._timed(part):
                return original(*args, **kwargs)

        self._patch(owner, name, wrapper)

    def remove(self) -> None:
        while self._undo:
            owner, name, original, own = self._undo.pop()
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the instance attribute shadowed its class's method

    # ---- report --------------------------------------------------------------------------
    def rows(self) -> list[dict]:
        out = []
        for kind in KINDS:
            stats = self.kinds.get(kind)
            if stats is None or not stats.steps:
                continue
            s = stats.seconds
            model_other = s["model"] - s["matmul"] - s["attention"]
            runner_other = s["total"] - s["model"] - s["lm_head"] - s["metadata"] - s["sampler"]
            parts = {"matmul": s["matmul"], "lm_head": s["lm_head"], "attention": s["attention"],
                     "sampler": s["sampler"], "metadata": s["metadata"], "model other": model_other,
                     "runner other": runner_other}
            out.append({"kind": kind, "steps": stats.steps, "tokens": stats.tokens, "total_s": s["total"],
                        "parts_s": parts, "flops": stats.flops,
                        "matmul_floor_s": stats.flops / self.mm_rate,
                        "weight_bytes_floor_s": stats.weight_bytes / self.bandwidth})
        return out

    def print_table(self, file=None) -> None:
        print(f"profile: matmul rate {self.mm_rate / 1e9:.0f} GFLOP/s ({self.runner.dtype}), memory "
              f"{self.bandwidth / 1e9:.1f} GB/s; ms per step, share of the step in brackets", file=file)
        head = f"{'step kind':<13}{'steps':>6}{'tok/step':>9}{'step ms':>9}"
        head += "".join(f"{p:>17}" for p in PARTS) + f"{'mm floor':>10}{'bytes floor':>12}"
        print(head, file=file)
        for row in self.rows():
            n, total = row["steps"], row["total_s"]
            line = f"{row['kind']:<13}{n:>6}{row['tokens'] / n:>9.1f}{1e3 * total / n:>9.2f}"
            for part in PARTS:
                sec = row["parts_s"][part]
                line += f"{1e3 * sec / n:>10.2f} ({100 * sec / total:>2.0f}%)" if total else f"{'-':>17}"
            line += f"{1e3 * row['matmul_floor_s'] / n:>10.2f}{1e3 * row['weight_bytes_floor_s'] / n:>12.2f}"
            print(line, file=file)

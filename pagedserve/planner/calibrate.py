"""`pagedserve calibrate`: time the worker's model runner on synthetic steps and fit the cost model.

The grid: prefill chunks of P tokens (on Cp tokens already cached), beside D decodes at context C.
Each point is a real SchedulerOutput run by the real ModelRunner (new requests that claim their
first tokens are cached, as prefix-cache hits do, so a decode at context C costs one step, not C).
The KV content is garbage (the timing does not depend on it); block ids wrap around a pool of at
most MAX_POOL_BLOCKS so a large grid needs no large pool. Each point runs once to warm up and then
--repeats times, its decodes continuing as cached requests (StepMaker); the median is kept. The
fit and its error are printed (cost_model.fit).

Fixed costs the runner does not see are flags (they come from `pagedserve bench services`: its
"scheduler->worker round trip beyond compute" is --step-overhead-ms) and a measurement (the
tokenizer's time per prompt token, when the model folder has a tokenizer).

Loads torch (it runs the model); the planner's simulator does not.
"""

from __future__ import annotations

import itertools
import statistics
import time

from pagedserve.common.messages import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.planner.cost_model import Profile, StepShape, fit

PREFILL_TOKENS = (32, 128, 512)
DECODE_SEQS = (1, 4, 16, 64)
CONTEXTS = (64, 512)
PREFILL_CONTEXTS = (0, 256)
QUICK = dict(prefill=(16, 64, 128), decode=(1, 4, 16), contexts=(32, 128), prefill_contexts=(0, 64))
MAX_POOL_BLOCKS = 2048


def grid_points(max_len: int, quick: bool, max_tokens: int) -> list[tuple[int, int, int, int]]:
    """(prefill tokens, prefill context, decodes, decode context) points that fit the model's
    context and the step budget; each with some work."""
    grid = QUICK if quick else dict(prefill=PREFILL_TOKENS, decode=DECODE_SEQS, contexts=CONTEXTS,
                                    prefill_contexts=PREFILL_CONTEXTS)
    points = set()
    for p, cp in itertools.product((0, *grid["prefill"]), grid["prefill_contexts"]):
        if p == 0:
            cp = 0
        elif cp + p > max_len - 1 or p > max_tokens:
            continue
        for d, c in itertools.product((0, *grid["decode"]), grid["contexts"]):
            if d == 0:
                c = 0
            elif c + 1 > max_len - 1 or p + d > max_tokens:
                continue
            if p or d:
                points.add((p, cp, d, c))
    return sorted(points)


class StepMaker:
    """SchedulerOutputs for grid points, over a wrapped pool of block ids. A point's first step
    (rep 0, the warm-up) sends its requests new; the next ones run the same decodes again as cached
    requests one token further on, as a server's decodes run, beside a fresh prefill chunk (a new
    request's first chunk, as in serving). Each point's first step drops the previous point's."""

    def __init__(self, block_size: int, num_blocks: int, vocab_size: int, max_reps: int = 8,
                 num_kv_groups: int = 1) -> None:
        self.block_size, self.num_blocks, self.vocab = block_size, num_blocks, vocab_size
        self.num_kv_groups = num_kv_groups  # a table per KV group (common/model_config.KVGroups)
        self.max_reps = max_reps
        self.next_block = 0
        self.step_id = 0
        self.live: list[str] = []
        self.decodes: list[str] = []
        self.prefills: list[str] = []
        self.params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)

    def _blocks(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // self.block_size)
        ids = [(self.next_block + i) % self.num_blocks for i in range(count)]
        self.next_block = (self.next_block + count) % self.num_blocks
        return ids

    def _request(self, num_cached: int, num_new: int, spare: int = 0) -> str:
        req_id = f"cal-{self.step_id}-{len(self.new)}"
        tokens = [(7 + 31 * i) % self.vocab for i in range(num_cached + num_new)]
        tables = [self._blocks(len(tokens) + 1 + spare) for _ in range(self.num_kv_groups)]
        self.new.append(NewRequestData(req_id, tokens, len(tokens), self.params, tables[0], num_cached,
                                       group_block_ids=tables[1:]))
        self.scheduled[req_id] = num_new
        return req_id

    def step(self, p: int, cp: int, d: int, c: int, rep: int = 0) -> tuple[SchedulerOutput, StepShape]:
        if rep > self.max_reps:
            raise ValueError(f"at most {self.max_reps} runs of one point (its blocks are sized for that)")
        self.step_id += 1
        self.new: list[NewRequestData] = []
        self.scheduled: dict[str, int] = {}
        shape = StepShape()
        cached = []
        if rep == 0:
            finished = self.live
            self.decodes = [self._request(c, 1, spare=self.max_reps) for _ in range(d)]
        else:
            finished = self.prefills
            for req_id in self.decodes:  # decodes first, as the scheduler orders them
                cached.append(CachedRequestData(req_id, []))
                self.scheduled[req_id] = 1
        for _ in self.decodes:
            shape.add(1, c + rep, c + rep + 1)
        self.prefills = [self._request(cp, p)] if p else []
        if p:
            shape.add(p, cp, cp + p)
        out = SchedulerOutput(self.step_id, self.new, cached, self.scheduled, finished_req_ids=list(finished))
        self.live = list(self.scheduled)
        return out, shape


def measure_tokenizer(model_path) -> float:
    """Seconds per token of the model's tokenizer on plain English (0 when it has none)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
    except Exception:  # noqa: BLE001 - a model without tokenizer files: nothing to time
        return 0.0
    from pagedserve.bench.serve_datasets import WORDS

    text = " ".join(WORDS * 4)
    start = time.perf_counter()
    n = sum(len(tok(text, add_special_tokens=False).input_ids) for _ in range(5))
    return (time.perf_counter() - start) / max(1, n)


def calibrate(args) -> Profile:
    import torch

    from pagedserve.common import settings
    from pagedserve.common.model_config import ModelConfig
    from pagedserve.model_files.default_model import resolve_model
    from pagedserve.worker.kv_cache import bytes_per_block
    from pagedserve.worker.lora.weights import linear_macs_per_token, lora_macs_per_rank
    from pagedserve.worker.model_runner import ModelRunner
    from pagedserve.worker.model_setup import kv_cache_blocks, pick_device, pick_dtype, resolve_max_model_len

    model_path = resolve_model(args.model)
    mc = ModelConfig.from_folder(model_path)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    max_len = resolve_max_model_len(mc, args.max_model_len)
    budget, _ = settings.step_budgets(args.max_num_batched_tokens, args.long_prefill_token_threshold, device.type)
    bs = args.block_size
    runner = ModelRunner(mc, model_path, dtype, device, bs, max_len, eos_token_ids=(), progress=False)
    per_block = bytes_per_block(mc, bs, dtype)
    default_blocks, _ = kv_cache_blocks(runner, bs, args.kv_cache_memory, args.gpu_memory_utilization, budget, 0)
    points = grid_points(max_len, args.quick, max(budget, max(PREFILL_TOKENS)))
    pool = min(MAX_POOL_BLOCKS, default_blocks)
    runner.allocate_kv_cache(pool)
    maker = StepMaker(bs, pool, mc.vocab_size, max_reps=args.repeats, num_kv_groups=len(mc.kv_groups().layers))
    print(f"calibrating {model_path.name} on {device.type} ({str(dtype).removeprefix('torch.')}): "
          f"{len(points)} step shapes x {args.repeats} runs", flush=True)
    samples, records = [], []
    for point in points:
        times = []
        for rep in range(args.repeats + 1):
            step, shape = maker.step(*point, rep=rep)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            runner.execute(step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if rep:  # the first run of a shape warms caches and kernels
                times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        samples.append((shape, seconds))
        records.append({"prefill_tokens": point[0], "prefill_context": point[1], "decode_seqs": point[2],
                        "decode_context": point[3], "seconds": seconds})
    cost = fit(samples)
    for record, (shape, _) in zip(records, samples):
        record["predicted_seconds"] = cost.predict(shape)
    print(cost.fit.line())
    print(f"knee at {cost.knee} tokens; coefficients:\n{cost.explain()}")
    profile = Profile(model=str(model_path), device=device.type, dtype=str(dtype).removeprefix("torch."), cost=cost,
                      kv_bytes_per_token=per_block // bs, max_model_len=max_len,
                      default_kv_cache_bytes=default_blocks * per_block,
                      step_overhead_s=args.step_overhead_ms / 1e3, request_overhead_s=args.request_overhead_ms / 1e3,
                      tokenize_s_per_token=measure_tokenizer(model_path), samples=records,
                      linear_macs_per_token=linear_macs_per_token(runner.model),
                      lora_macs_per_rank=lora_macs_per_rank(runner.model), weight_bytes=runner.weight_bytes(),
                      dtype_bytes=torch.tensor([], dtype=dtype).element_size())
    return profile


def run_calibrate(args) -> int:
    profile = calibrate(args)
    profile.save(args.out)
    print(f"wrote {args.out}")
    return 0

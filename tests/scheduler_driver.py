"""The scheduler tests' driver: a scheduler stepped together with a fake worker (no torch), the
checks run after every step, and a shared workload with its reference outputs.

The fake worker keeps its own state from the SchedulerOutput deltas only, with the real
ModelRunner's own bookkeeping (pagedserve.worker.request_states), and simulates the KV
cache slot by slot: each computed position writes a key naming the token prefix it was computed
from, and every scheduled request checks that all its earlier positions read back their own keys.
"Sampling" is a deterministic function of the token ids, so every request's output is known in
advance and must not depend on pool size, preemption mode, prefix caching or chunking.

With KV groups (SchedulerConfig.kv_group_windows: a sliding-window model) every group's table is
written, and read back: a full group at every position, a sliding group (window W) from the first
query's window start (num_computed - W + 1) on; a sliding group must never hold more than the
blocks its window and the step's chunk reach.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.common.messages import ModelRunnerOutput, SampledToken, SchedulerOutput
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.scheduler.core.block_manager import cdiv
from pagedserve.scheduler.core.request import Request, RequestStatus
from pagedserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.worker.request_states import RequestStates


def next_token(token_ids: list[int], sample_index: int = 0) -> int:
    return (sum(token_ids) * 31 + len(token_ids) + 101 * sample_index) % 1000


def expected_outputs(prompt: list[int], max_tokens: int, n: int = 1) -> dict[int, list[int]]:
    """sample index -> output tokens, for greedy decoding with next_token."""
    outs = {}
    for i in range(n):
        tokens = list(prompt) + [next_token(prompt, i)]
        while len(tokens) - len(prompt) < max_tokens:
            tokens.append(next_token(tokens))
        outs[i] = tokens[len(prompt):]
    return outs


def params(max_tokens: int = 8, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


def make_request(req_id: str, prompt: list[int], max_tokens: int = 8, n: int = 1, priority: int = 0,
                 arrival: float = 0.0) -> Request:
    return Request(req_id, list(prompt), len(prompt), params(max_tokens, n), priority=priority,
                   arrival_time=arrival)


# ---- the fake worker ----------------------------------------------------------------------------

def prefix_key(token_ids: list[int], pos: int, cache: list) -> object:
    """A key naming token_ids[:pos + 1]: what the KV at position pos was computed from."""
    while len(cache) <= pos:
        prev = cache[-1] if cache else None
        cache.append(hash((prev, token_ids[len(cache)])))
    return cache[pos]


class FakeWorker:
    """Keeps the worker's request state with the model runner's own bookkeeping (RequestStates),
    and a simulated KV cache slot by slot."""

    def __init__(self, sched: Scheduler, check_kv: bool = True, ahead: bool = False) -> None:
        self.sched = sched
        self.ahead = ahead  # steps run as they are scheduled, before the last one's update (async)
        self.bs = sched.config.block_size
        self.check_kv = check_kv
        self.requests = RequestStates()
        self.keys: dict[str, list] = {}  # req_id -> prefix keys by position
        self.kv: dict[tuple[int, int], object] = {}  # (device block, offset) -> key
        self.host: dict[tuple[int, int], object] = {}
        self.kv_errors: list[str] = []
        self.dropped: dict[str, object] = {}  # req_id -> its state when the worker last dropped it
        self.windows = sched.config.kv_group_windows
        self.hybrid = any(self.windows)

    @staticmethod
    def tables(state) -> list[list[int]]:
        return [state.block_ids, *state.group_block_ids]

    def key(self, state, pos: int):
        return prefix_key(state.token_ids, pos, self.keys.setdefault(state.req_id, []))

    def _copy(self, src_map, src, dst_map, dst):
        for off in range(self.bs):
            if (src, off) in src_map:
                dst_map[(dst, off)] = src_map[(src, off)]
            else:
                dst_map.pop((dst, off), None)

    def _block_ops(self, out: SchedulerOutput) -> None:
        # Swap-outs first (their device blocks may be reused this step), then swap-ins, then copies.
        for dev, host in out.blocks_to_swap_out:
            self._copy(self.kv, dev, self.host, host)
        for host, dev in out.blocks_to_swap_in:
            self._copy(self.host, host, self.kv, dev)
        for src, dst in out.blocks_to_copy:
            assert src != dst
            self._copy(self.kv, src, self.kv, dst)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sched = self.sched
        for req_id in out.finished_req_ids:
            assert req_id in self.requests, f"told to drop {req_id!r}, which the worker never had"
            self.keys.pop(req_id, None)
            self.dropped[req_id] = self.requests[req_id]
        for new in out.new_requests:
            assert new.req_id not in self.requests, f"{new.req_id} sent as new twice"
            self.keys.pop(new.req_id, None)
        for cached in out.cached_requests:
            assert cached.req_id in self.requests, f"delta for {cached.req_id}, unknown to the worker"
            if cached.block_ids is not None and cached.new_block_ids:
                assert cached.block_ids[-len(cached.new_block_ids):] == cached.new_block_ids
        self.requests.apply(out, self._block_ops)

        # The worker's state equals the scheduler's: the deltas were sufficient.
        live = {r.request_id for r in sched.running} | {r.request_id for r in sched.swapped}
        held = set(self.requests)
        if self.ahead:
            # Samples the worker forked in a step whose results the scheduler awaits (and forks of
            # a request aborted meanwhile: dropped once those results are in; flush() checks).
            held -= {child for r in sched.running for child in r.child_req_ids}
            held -= {i for i in held if i not in sched.sample_ids}
        assert held == live, f"worker holds {sorted(self.requests)}, scheduler {sorted(live)}"
        bm = sched.block_manager
        for req in sched.running:
            state = self.requests[req.request_id]
            assert state.block_ids == bm.block_ids(req.request_id), req.request_id
            # Sliding groups: the worker is not told of dropped blocks (id 0 in the scheduler's table).
            for mine, theirs in zip(state.group_block_ids, bm.group_block_ids(req.request_id), strict=True):
                assert len(mine) == len(theirs) and all(t in (0, m) for m, t in zip(mine, theirs)), req.request_id
            # The worker has run every step before this one; ahead, the scheduler awaits the results
            # of the last (the worker's samples there are tokens the scheduler counts as pending).
            assert state.num_computed_tokens == req.num_scheduled_tokens - out.num_scheduled_tokens.get(
                req.request_id, 0), req.request_id
            if self.ahead:
                assert state.token_ids[:req.num_tokens] == req.token_ids, req.request_id
                assert len(state.token_ids) <= req.num_tokens + req.num_pending_samples, req.request_id
            else:
                assert state.token_ids == req.token_ids, req.request_id

        written: dict[tuple[int, int], str] = {}
        for req_id, n in out.num_scheduled_tokens.items():
            assert n >= 1, f"{req_id} scheduled for {n} tokens"
            state = self.requests[req_id]
            assert sched.requests[req_id].status is RequestStatus.RUNNING
            c = state.num_computed_tokens
            assert c + n <= len(state.token_ids), f"{req_id} runs past its known tokens"
            for table in self.tables(state):
                for pos in range(c, c + n):
                    index = pos // self.bs
                    assert index < len(table), f"{req_id}: position {pos} has no block"
                    assert not (self.hybrid and table[index] == 0), f"{req_id} writes the null block"
                    slot = (table[index], pos % self.bs)
                    assert slot not in written, f"{req_id} and {written[slot]} write slot {slot} in one step"
                    written[slot] = req_id
                    self.kv[slot] = self.key(state, pos)
        if self.check_kv:
            for req_id, n in out.num_scheduled_tokens.items():
                state = self.requests[req_id]
                c = state.num_computed_tokens
                for table, window in zip(self.tables(state), self.windows):
                    for pos in range(max(0, c - window + 1) if window else 0, c + n):
                        slot = (table[pos // self.bs], pos % self.bs)
                        if self.kv.get(slot) != self.key(state, pos):
                            self.kv_errors.append(
                                f"step {out.step_id}: {req_id} reads a wrong KV at position {pos}")
                            break

        scheduled = [(self.requests[r], n) for r, n in out.num_scheduled_tokens.items()]
        self.requests.advance(scheduled)
        sampled: dict[str, list[int]] = {}
        for state, _ in scheduled:
            if state.num_computed_tokens < len(state.token_ids):
                continue
            # Greedy: only the fork step draws distinct tokens (one per sample).
            indices = [0] if not state.child_req_ids else range(1 + len(state.child_req_ids))
            sampled[state.req_id] = [next_token(state.token_ids, i) for i in indices]
        for req_id in sampled:
            for child_id in self.requests[req_id].child_req_ids:
                self.keys.pop(child_id, None)
        self.requests.commit(sampled)
        return ModelRunnerOutput(out.step_id, {r: [SampledToken(t) for t in tokens] for r, tokens in sampled.items()},
                                 grammars_ready=[g.key() for g in out.grammars])  # compiles nothing


@dataclass
class RunResult:
    outputs: dict[str, list[int]]
    finish_reasons: dict[str, str]
    steps: list[SchedulerOutput]
    num_preemptions: int
    sched: Scheduler
    worker: FakeWorker


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    assert set(out.num_scheduled_tokens) <= {r.request_id for r in sched.running}
    ids = [e.req_id for e in out.new_requests] + [e.req_id for e in out.cached_requests]
    assert len(ids) == len(set(ids)) and set(ids) <= set(out.num_scheduled_tokens)
    for queue, status in ((sched.waiting, RequestStatus.WAITING), (sched.running, RequestStatus.RUNNING),
                          (sched.swapped, RequestStatus.SWAPPED)):
        assert all(r.status is status for r in queue)
        keys = [r.sort_key() for r in queue]
        assert keys == sorted(keys)
    bm = sched.block_manager
    for req in sched.running:
        assert len(bm.tables[req.request_id]) == cdiv(req.num_scheduled_tokens, bm.block_size)
    for req in sched.swapped:
        assert req.request_id in bm.cpu_tables and req.request_id not in bm.tables
    for req in sched.waiting:
        assert req.request_id not in bm.tables and req.num_computed_tokens == 0
    # Every group's table covers the same tokens; a sliding group holds only what its window
    # and this step's chunk reach.
    for req in sched.running:
        n = out.num_scheduled_tokens.get(req.request_id, 0)
        for tables, window in zip(bm.group_tables, bm.windows):
            table = tables[req.request_id]
            assert len(table) == len(bm.tables[req.request_id])
            if window and n:
                held = sum(b is not bm.null_block for b in table)
                assert held <= cdiv(window - 1 + n, bm.block_size) + 1, (req.request_id, held)
    # Reference counts equal the number of tables holding each block; nothing leaked.
    counts = {}
    for tables in bm.group_tables:
        for table in tables.values():
            for block in table:
                if block is not bm.null_block:
                    counts[block.block_id] = counts.get(block.block_id, 0) + 1
    for block in bm.pool.blocks:
        if block is not bm.null_block:
            assert block.ref_count == counts.get(block.block_id, 0)
    assert bm.num_free_blocks + len(counts) == bm.num_total_blocks


class Driver:
    """A scheduler and its fake worker, stepped together. ahead: as the scheduler service steps
    with async scheduling: each step runs on the worker as soon as it is scheduled, and the next
    one is scheduled (schedule(ahead=True)) before its results are given to update()."""

    def __init__(self, cfg: SchedulerConfig, check_kv: bool = True, ahead: bool = False) -> None:
        self.sched = Scheduler(cfg)
        self.worker = FakeWorker(self.sched, check_kv, ahead)
        self.ahead = ahead
        self.inflight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
        self.outputs: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}
        self.steps: list[SchedulerOutput] = []

    def add(self, *requests: Request) -> None:
        for req in requests:
            self.sched.add_request(req)

    def _send(self, out: SchedulerOutput) -> None:
        check_step(self.sched, out)
        self.steps.append(out)
        self.inflight.append((out, self.worker.execute(out)))

    def step(self) -> SchedulerOutput:
        """Schedule (and run) a step, then take in the oldest step's results; returns that step."""
        sched = self.sched
        if not self.inflight:
            self._send(sched.schedule())
        if self.ahead and len(self.inflight) == 1 and not sched.needs_sync:
            ahead = sched.schedule(ahead=True)
            if ahead is not None:
                self._send(ahead)
        out, result = self.inflight.pop(0)
        for upd in sched.update(out, result):
            if upd.finished:
                self.outputs[upd.request.request_id] = upd.request.output_token_ids
                self.reasons[upd.request.request_id] = upd.request.finish_reason
        check_after_update(sched)
        return out

    def run(self, max_steps: int = 3000, on_step=None) -> None:
        for _ in range(max_steps):
            if not (self.sched.has_unfinished() or self.inflight):
                break
            out = self.step()
            if on_step is not None:
                on_step(self, out)
        assert not self.sched.has_unfinished(), "no progress: the scheduler does not finish its requests"

    def flush(self) -> None:
        """One empty step tells the worker to drop the last finished requests."""
        out = self.step()
        assert not out.num_scheduled_tokens
        assert not self.worker.requests


def check_after_update(sched: Scheduler) -> None:
    assert len(sched.running) <= sched.config.max_num_seqs, (
        f"{len(sched.running)} running sequences, max_num_seqs is {sched.config.max_num_seqs}")
    bm = sched.block_manager
    for req in sched.running:
        assert len(bm.tables[req.request_id]) == cdiv(req.num_scheduled_tokens, bm.block_size)


def run(cfg: SchedulerConfig, requests: list[Request], check_kv: bool = True, max_steps: int = 3000,
        on_step=None, ahead: bool = False) -> RunResult:
    d = Driver(cfg, check_kv, ahead)
    d.add(*requests)
    d.run(max_steps, on_step)
    d.flush()
    return RunResult(d.outputs, d.reasons, d.steps, d.sched.num_preemptions, d.sched, d.worker)


def assert_drained(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    assert not (sched.waiting or sched.running or sched.swapped)
    assert not sched.requests and not sched.groups
    assert not bm.tables and not bm.cpu_tables and not bm.block_hashes and not bm.num_cached_blocks
    if bm.cpu_pool is not None:
        assert bm.cpu_pool.num_free == bm.cpu_pool.num_blocks
    assert all(b.ref_count == 0 for b in bm.pool.blocks if b is not bm.null_block)
    assert not any(t for tables in bm.group_tables + bm.group_cpu_tables for t in tables)


# ---- workload -----------------------------------------------------------------------------------

SHARED = [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3, 5, 3, 6]


def workload(with_n: bool = True) -> list[tuple[str, list[int], int, int]]:
    """(id, prompt, max_tokens, n): shared prefixes, partial and exact last blocks, long prompts."""
    w = [
        ("a", SHARED[:13], 12, 1),
        ("b", SHARED[:16] + [11, 12, 13], 9, 1),
        ("c", SHARED + [1] * 10, 6, 1),
        ("d", list(range(30, 37)), 15, 1),
        ("e", SHARED[:8], 10, 1),
        ("f", SHARED[:13], 12, 1),  # same prompt as a
        ("g", list(range(50, 75)), 4, 1),
        ("h", [3], 7, 1),
    ]
    if with_n:
        w += [("p", SHARED[:10] + [99], 5, 3), ("q", SHARED[:12], 6, 2)]
    return w


def make_requests(work) -> list[Request]:
    return [make_request(rid, prompt, mt, n, arrival=float(i)) for i, (rid, prompt, mt, n) in enumerate(work)]


def reference(work) -> dict[str, list[int]]:
    ref = {}
    for rid, prompt, mt, n in work:
        for i, out in expected_outputs(prompt, mt, n).items():
            ref[rid if i == 0 else f"{rid}#{i}"] = out
    return ref

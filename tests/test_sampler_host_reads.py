"""The sampler reads device values back once per step (issue 37 item 5): every row kind at once (greedy,
temperature with top-k / top-p / min-p, seeded, penalties, logit_bias past the vocabulary, min_tokens,
logprobs with top logprobs) samples with no host read at all (Sampler.sample) and then costs one, when the
step takes its result (PendingSample.result: the one device->host copy, non-blocking on CUDA), counted with a
torch function mode that sees every tolist / item / bool / numpy / cpu call, and no tensor is indexed by a
Python list (on a GPU that copies the list up and waits); the values read back equal log_softmax computed
apart. A dispatch mode sees the aten ops that wait on CUDA below the Python API (scalar reads, boolean-mask
indexing, repeat_interleave without its output size): sampling runs none. Seeded rows are drawn together:
the aten ops of a step are the same for 1 seeded row as for 8 (none per row). The sampler runs its device
forms (Sampler(device_forms=True)): on the CPU penalties read each row's seen tokens on the host."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.logit_rules import _apply_token_masks_torch
from pagedserve.worker.sampler import RowSampling, Sampler
from pagedserve.worker.seeded_draws import exponentials_torch, stream_key
from pagedserve.worker.structured_output import TokenMasks

READS = {"tolist", "item", "__bool__", "numpy", "cpu", "__int__", "__float__", "__index__"}
# aten ops that wait for the device on CUDA: a scalar read, or an output whose shape depends on the values
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero",
            "repeat_interleave"}


class SyncOps(TorchDispatchMode):
    """The aten ops below the Python API (a boolean-mask index becomes nonzero, a tensor of repeats
    without output_size a scalar read), which a function mode does not see."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS and not (name == "repeat_interleave" and (kwargs or {}).get("output_size")):
            self.syncs.append(name)
        if name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
            self.syncs.append(name + " by a mask")
        return func(*args, **(kwargs or {}))


class AllOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.reads.append(name)
        if name in ("__getitem__", "__setitem__") and _has_list(args[1:2]):
            self.reads.append(name + " by a list")
        return func(*args, **(kwargs or {}))


def _has_list(values) -> bool:
    return any(isinstance(v, list) or (isinstance(v, tuple) and _has_list(v)) for v in values)


def _rows(vocab: int) -> list[RowSampling]:
    def row(seed=None, output=(), **kw):
        key = stream_key(seed, 0, 0) if seed is not None else None
        return RowSampling(SamplingParams(**kw), key, [1, 2, 3], list(output), (0,))
    return [
        row(temperature=0.0),
        row(temperature=0.0, logprobs=3),
        row(temperature=0.8, top_k=5, seed=1, logprobs=0),
        row(temperature=1.0, top_p=0.9, min_p=0.05, logprobs=2),
        row(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
            output=[4, 4, 5], logprobs=1),
        row(temperature=0.0, logit_bias={7: 5.0, vocab + 3: 1.0}),
        row(temperature=0.7, min_tokens=4, output=[6]),
    ]


def test_one_host_read_per_step_with_every_row_kind():
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(7, vocab)
    rows = _rows(vocab)
    with HostReads() as mode, SyncOps() as syncs:
        pending = Sampler(device_forms=True).sample(logits, rows)
    assert mode.reads == [] and syncs.syncs == []
    with HostReads() as mode:
        out = pending.result()
    assert mode.reads == ["tolist"] and pending.result() is out
    expected = torch.log_softmax(logits.float(), -1)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert isinstance(token, int) and 0 <= token < vocab
        assert abs(lp - expected[i, token].item()) < 1e-5
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.top_logprobs[0] is None and out.top_logprobs[2] == [] and out.top_logprobs[5] is None
    for i, n in ((1, 3), (3, 2), (4, 1)):
        vals, ids = expected[i].topk(n)
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert max(abs(v - w) for (_, v), w in zip(out.top_logprobs[i], vals.tolist())) < 1e-5
        assert all(isinstance(t, int) for t, _ in out.top_logprobs[i])


def test_greedy_and_plain_sampling_read_once():
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=3, top_p=0.8)):
        rows = [RowSampling(params, None, [], [], (0,)) for _ in range(3)]
        with HostReads() as mode, SyncOps() as syncs:
            pending = Sampler(device_forms=True).sample(logits, rows)
        assert mode.reads == [] and syncs.syncs == []
        with HostReads() as mode:
            pending.result()
        assert mode.reads == ["tolist"]


def test_device_grammar_masks_read_nothing_and_revive_dead_rows():
    """The torch (GPU) mask path decides per row on the device: a row the grammar leaves empty (only eos,
    which min_tokens blocked) takes the grammar's choice over the raw logits, the others keep theirs."""
    vocab = 64
    raw = torch.randn(3, vocab)
    x = raw.clone()
    x[1, 9] = float("-inf")  # row 1's only allowed token was blocked: the row is dead after the mask
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 0b1010  # row 0 allows tokens 1 and 3
    bitmask[1, 0] = 1 << 9  # row 1 allows token 9 only
    masks = TokenMasks(torch.tensor([0, 1]), bitmask)
    with HostReads() as mode:
        _apply_token_masks_torch(x, raw, masks)
    assert mode.reads == []
    assert torch.isinf(x[0]).sum() == vocab - 2 and x[0, 1] == raw[0, 1] and x[0, 3] == raw[0, 3]
    assert torch.isinf(x[1]).sum() == vocab - 1 and x[1, 9] == raw[1, 9]
    assert torch.equal(x[2], raw[2])


def test_seeded_rows_cost_the_same_ops_for_one_row_as_for_eight():
    """The seeded rows' draws are one batch of ops (seeded_draws.py), not a launch per row; alone, and beside
    unseeded rows (which keep the global RNG)."""
    vocab = 50
    seeded = SamplingParams(temperature=0.8, top_k=10, seed=3)
    plain = SamplingParams(temperature=0.9)

    def ops(num_seeded: int, num_plain: int) -> list[str]:
        rows = [RowSampling(seeded, stream_key(3, 0, pos), [], [], (0,)) for pos in range(num_seeded)]
        rows += [RowSampling(plain, None, [], [], (0,)) for _ in range(num_plain)]
        logits = torch.randn(len(rows), vocab)
        with AllOps() as mode, HostReads() as reads, SyncOps() as syncs:
            pending = Sampler(device_forms=True).sample(logits, rows)
        assert reads.reads == [] and syncs.syncs == []
        assert all(0 <= t < vocab for t in pending.result().token_ids)
        return mode.ops

    assert ops(1, 0) == ops(8, 0)
    assert ops(1, 1) == ops(8, 3)

    def device_ops(num_seeded: int) -> list[str]:  # the torch path a GPU runs (the CPU's is numpy)
        keys = torch.tensor([stream_key(3, 0, pos) for pos in range(num_seeded)])
        with AllOps() as mode, HostReads() as reads, SyncOps() as syncs:
            exponentials_torch(keys, vocab)
        assert reads.reads == [] and syncs.syncs == []
        return mode.ops

    assert device_ops(1) == device_ops(8) and len(device_ops(1)) <= 30  # 24 today

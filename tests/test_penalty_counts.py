"""Penalties read token histories kept on the device between steps (pagedserve/worker/penalty_counts.py): greedy
tokens with repetition, presence and frequency penalties equal a plain reference over transformers' logits
(synchronous and with async scheduling, whose steps now overlap with penalised rows held; with chunked
prefill and preemption; with n-gram proposals verified); after every sync each penalised
state's rows equal its token lists (forks, preemption, proposals, async scheduling); the sampler's penalties
from the rows equal its penalties from the lists, a verifying row's proposals included; rows grow, are freed
and are rebuilt for a replaced state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.penalty_counts import PenaltyCounts
from pagedserve.worker.penalties import apply_penalties
from pagedserve.worker.sampler import RowSampling
from tiny_models import make_engine

PENALTIES = [dict(repetition_penalty=1.3), dict(presence_penalty=0.8, frequency_penalty=0.6),
             dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.3),
             dict(), dict(repetition_penalty=1.5, min_tokens=3),
             dict(frequency_penalty=-1.5, presence_penalty=-1.0)]  # encourages repeats: n-gram proposals


# proposals at any batch size (the default stops at 6 running requests)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1,
         "disable_by_batch_size": 0}


def reference(folder, prompt: list[int], steps: int, p: dict) -> list[int]:
    """transformers' float32 logits a step (the whole sequence again, no cache), then the penalties as the
    server defines them: repetition over prompt + outputs (as transformers' RepetitionPenaltyLogitsProcessor),
    presence and frequency over the outputs (as OpenAI's), and the argmax."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids, out = list(prompt), []
    for _ in range(steps):
        with torch.no_grad():
            x = model(torch.tensor([ids])).logits[0, -1].clone()
        rep = p.get("repetition_penalty", 1.0)
        seen = torch.tensor(sorted(set(ids)))
        x[seen] = torch.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[0]).float()
        x -= p.get("presence_penalty", 0.0) * (counts > 0) + p.get("frequency_penalty", 0.0) * counts
        out.append(int(x.argmax()))
        ids.append(out[-1])
    return out


def prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 256, (int(length),), generator=gen).tolist()
            for length in torch.randint(4, 40, (n - 1,), generator=gen)]
    return rows + [[5, 6, 7, 8, 9] * 5]  # a loop: proposals that the model's tokens may follow


@pytest.mark.parametrize("setup", ["plain", "async", "chunks and preemption", "ngram"])
def test_greedy_penalties_equal_the_reference(tiny_llama, setup):
    overrides = {"plain": dict(async_scheduling=False), "async": dict(async_scheduling=True),
                 "chunks and preemption": dict(max_num_batched_tokens=16, kv_cache_memory=24 * 4096),
                 "ngram": dict(speculative_config=NGRAM)}[setup]
    engine = make_engine(tiny_llama, **overrides)
    batch = prompts(len(PENALTIES), seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, **p) for p in PENALTIES]
    got = [samples[0].token_ids for samples in engine.generate(batch, params)]
    assert got == [reference(tiny_llama, prompt, 14, p) for prompt, p in zip(batch, PENALTIES)]
    if setup == "async":
        assert engine.overlaps and engine.runner.held_rows > 50  # penalised rows fed on the device
    if setup == "chunks and preemption":
        assert engine.stats()["num_preemptions"] > 0
    if setup == "ngram":
        assert engine.stats()["spec_decode"]["num_accepted_tokens"] > 0


def rows_equal_lists(counts: PenaltyCounts, states, rows) -> None:
    """Each state's rows count its outputs and mark its prompt; a held place (async scheduling: the step in
    flight samples it, its id not yet on the host) is one more count, of some token."""
    vocab = counts.vocab
    for state, row in zip(states, rows):
        end = len(state.token_ids) if state.held_at < 0 else state.held_at
        outputs = torch.tensor(state.token_ids[state.num_prompt_tokens:end], dtype=torch.long)
        extra = counts.output[row].cpu() - torch.bincount(outputs, minlength=vocab).float()
        held = len(state.token_ids) - end
        assert extra.min() >= 0 and extra.sum() == held and extra.max() == held, state.req_id
        prompt = torch.zeros(vocab, dtype=torch.bool)
        prompt[torch.tensor(state.token_ids[:state.num_prompt_tokens])] = True
        assert torch.equal(counts.prompt[row].cpu(), prompt), state.req_id
    assert len(set(rows)) == len(rows)
    assert sum(owner is not None for owner in counts.owners) == len(rows)  # the others' rows freed


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rows_equal_the_token_lists_after_every_sync(tiny_llama, monkeypatch, async_scheduling):
    """Forks (n = 2, seeded), preemption in a small pool, n-gram proposals, rows of plain requests beside, and
    with async scheduling penalised rows held (their sampled ids counted on the device)."""
    checks, held = [], []
    sync = PenaltyCounts.sync

    def checked_sync(self, states):
        rows = sync(self, states)
        rows_equal_lists(self, states, rows)
        checks.append(len(rows))
        held.extend(s.held_at >= 0 for s in states)
        return rows

    monkeypatch.setattr(PenaltyCounts, "sync", checked_sync)
    engine = make_engine(tiny_llama, max_num_batched_tokens=16, long_prefill_token_threshold=4,
                         kv_cache_memory=24 * 4096, async_scheduling=async_scheduling,
                         speculative_config=NGRAM)  # (a schedule that preempts: the cap set, not the default)
    batch = prompts(5, seed=8)
    params = [SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=10, ignore_eos=True, repetition_penalty=1.2,
                             frequency_penalty=-1.0),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, presence_penalty=0.4),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, frequency_penalty=-1.5),
              SamplingParams(temperature=0.7, seed=2, max_tokens=11, ignore_eos=True, repetition_penalty=0.8)]
    outputs = engine.generate(batch, params)
    assert [len(s) for s in outputs] == [2, 1, 1, 1, 1]
    assert engine.stats()["num_preemptions"] > 0 and max(checks) >= 3 and len(checks) > 10
    assert engine.stats()["spec_decode"]["num_draft_tokens"] > 0
    assert any(held) == async_scheduling  # penalised rows held and fed on the device with async scheduling


def test_penalties_from_rows_equal_penalties_from_lists():
    """Rows or lists, over the whole vocabulary (the device's form) or on the seen tokens (the CPU's): the
    same values, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    vocab = 50
    counts = PenaltyCounts(vocab, torch.device("cpu"), rows=2)
    states = [SimpleNamespace(token_ids=torch.randint(0, vocab, (n,), generator=gen).tolist(), num_prompt_tokens=p,
                              held_at=-1) for n, p in ((12, 5), (30, 30), (7, 2))]
    table_rows = counts.sync(states)
    settings = [SamplingParams(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2),
                SamplingParams(repetition_penalty=0.7), SamplingParams(frequency_penalty=-0.5),
                SamplingParams()]
    extra = [[], [4, 4], [], [9]]  # a verifying row's proposals before it
    owner = [0, 0, 2, 1]
    by_lists, by_rows = [], []
    for i, p in enumerate(settings):
        s = states[owner[i]]
        by_lists.append(RowSampling(p, None, s.token_ids[:s.num_prompt_tokens],
                                    s.token_ids[s.num_prompt_tokens:] + extra[i], ()))
        by_rows.append(RowSampling(p, None, [], [], (), table_rows[owner[i]], extra[i]))
    logits = torch.randn(4, vocab, generator=gen) * 3
    want = logits.clone()
    apply_penalties(want, by_lists, sparse=False)  # the device's form: over the whole vocabulary
    assert not torch.equal(want, logits)
    for rows, table in ((by_lists, None), (by_rows, counts)):
        for sparse in (False, True):  # True: the CPU's form, on each row's seen tokens alone
            got = logits.clone()
            apply_penalties(got, rows, table, sparse=sparse)
            assert torch.equal(got, want), (table is not None, sparse)


def test_rows_grow_are_freed_and_rebuilt_for_a_replaced_state():
    counts = PenaltyCounts(10, torch.device("cpu"), rows=2)
    a, b, c = (SimpleNamespace(token_ids=[1, 2, 3], num_prompt_tokens=2, held_at=-1) for _ in range(3))
    assert counts.sync([a, b, c]) == [0, 1, 2] and counts.output.shape == (4, 10)  # doubled
    a.token_ids += [3, 7]
    assert counts.sync([a, c]) == [0, 2]  # b's row freed; a gains its two new tokens only
    assert counts.output[0].tolist() == [0, 0, 0, 2, 0, 0, 0, 1, 0, 0] and counts.owners[1] is None
    a2 = SimpleNamespace(token_ids=[5, 5, 5], num_prompt_tokens=1, held_at=-1)  # a recomputed a: a new state
    assert counts.sync([a2, c]) == [0, 2]  # a's row freed first, the new state takes it, rebuilt from its lists
    assert counts.output[0].tolist() == [0] * 5 + [2] + [0] * 4
    assert counts.prompt[0].tolist() == [False] * 5 + [True] + [False] * 4
    held = SimpleNamespace(token_ids=[1, 4, 0], num_prompt_tokens=1, held_at=2)  # a held place is not counted
    row = counts.sync([held])[0]
    assert counts.output[row].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    big = SimpleNamespace(token_ids=[1, 12, 3], num_prompt_tokens=1, held_at=-1)  # ids past the vocabulary: left out
    assert counts.output[counts.sync([big])[0]].sum() == 1


def test_rows_are_written_and_read_without_a_host_read():
    """sync (new rows filled, new tokens added), the sampler's penalties from the rows and the sampled ids
    counted on the device read no device value
    and run no op that waits for the device (the sampler's own rule, tests/test_sampler_host_reads.py)."""
    from pagedserve.worker.sampler import Sampler
    from test_sampler_host_reads import HostReads, SyncOps

    counts = PenaltyCounts(40, torch.device("cpu"), rows=1)
    states = [SimpleNamespace(token_ids=[1, 2, 3, 3, 9], num_prompt_tokens=2, held_at=-1),
              SimpleNamespace(token_ids=[4, 5], num_prompt_tokens=2, held_at=-1)]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
    with HostReads() as reads, SyncOps() as syncs:
        rows = counts.sync(states)
        states[0].token_ids.append(7)
        rows = counts.sync(states)
        batch = [RowSampling(params, None, [], [], (0,), row, extra) for row, extra in ((rows[0], []), (rows[0], [8]),
                                                                                          (rows[1], []))]
        pending = Sampler(device_forms=True).sample(torch.randn(3, 40), batch, counts=counts)
        counts.add_sampled([rows[0], rows[1]], pending.token_ids, [0, 2])  # what the step's plain rows sampled
    assert reads.reads == [] and syncs.syncs == []
    assert counts.output[rows[1]].sum() == 1 and counts.counted[rows[1]] == 1
    assert len(pending.result().token_ids) == 3


def test_the_cpus_compiled_pass_equals_the_dense_form_at_a_full_vocabulary():
    """64 rows of 49,152 logits, histories of 1,200 tokens from a table: the CPU's compiled pass
    (logits_ops.cpp penalize_rows, compiled without fused multiply-adds) and the device's dense form give the
    same values bit for bit, for every mix of the three penalties."""
    gen = torch.Generator().manual_seed(3)
    vocab = 49152
    counts = PenaltyCounts(vocab, torch.device("cpu"), rows=64)
    # outputs from a few hundred tokens, so that counts reach 3 and more (a product that rounds)
    states = [SimpleNamespace(token_ids=torch.randint(0, vocab, (200,), generator=gen).tolist()
                              + torch.randint(0, 300 + 10 * i, (1000,), generator=gen).tolist(),
                              num_prompt_tokens=200, held_at=-1) for i in range(64)]
    table_rows = counts.sync(states)
    settings = [SamplingParams(repetition_penalty=1.1 + 0.01 * i, presence_penalty=0.1 * (i % 5),
                               frequency_penalty=0.37 * (i % 3) - 0.4) for i in range(64)]
    rows = [RowSampling(p, None, [], [], (), table_rows[i], []) for i, p in enumerate(settings)]
    logits = torch.randn(64, vocab, generator=gen) * 4
    want, got = logits.clone(), logits.clone()
    apply_penalties(want, rows, counts, sparse=False)
    apply_penalties(got, rows, counts, sparse=True)
    assert torch.equal(got, want) and not torch.equal(got, logits)

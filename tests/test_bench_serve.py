"""`pagedserve bench serve`'s arrival, statistics and dataset helpers, without a network. Against
the real services: tests/stack/test_bench_serve_stack.py."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from pagedserve.bench.serve import parse_sweep
from pagedserve.bench.serve_client import arrival_gaps, summarize
from pagedserve.bench.serve_datasets import PromptMaker, load_sharegpt, prefix_requests, random_requests


def test_poisson_arrivals_are_seeded_with_the_right_mean():
    gaps = arrival_gaps(20000, 4.0, seed=7)
    assert gaps == arrival_gaps(20000, 4.0, seed=7)
    assert gaps != arrival_gaps(20000, 4.0, seed=8)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert np.std(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    assert np.mean(arrival_gaps(20000, 4.0, seed=7, burstiness=4.0)) == pytest.approx(0.25, rel=0.03)
    assert arrival_gaps(5, math.inf, seed=0) == [0.0] * 5


def test_summary_math():
    s = summarize([float(v) for v in range(1, 101)])
    assert s == {"mean": 50.5, "median": 50.5, "p90": pytest.approx(90.1), "p99": pytest.approx(99.01)}
    assert summarize([3.0]) == {"mean": 3.0, "median": 3.0, "p90": 3.0, "p99": 3.0}
    assert summarize([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def test_sweep_parsing():
    assert parse_sweep("rates:1,2,inf") == ("rates", [1.0, 2.0, math.inf])
    assert parse_sweep("concurrency:1,4") == ("concurrency", [1.0, 4.0])
    for bad in ("speed:1", "rates:", "concurrency:1.5", "rates:0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_sweep(bad)


def test_random_and_prefix_datasets():
    words = PromptMaker(None)
    reqs = random_requests(50, 40, 20, 0.5, seed=3, maker=words)
    assert all(20 <= q.prompt_len <= 60 and 10 <= q.output_len <= 30 for q in reqs)
    assert all(len(q.prompt.split()) == q.prompt_len for q in reqs)
    assert [q.prompt for q in reqs] == [q.prompt for q in random_requests(50, 40, 20, 0.5, seed=3, maker=words)]

    class Tok:
        vocab_size = 1000
        all_special_ids = [0, 1, 2, 500]

    ids = PromptMaker(Tok())
    fixed = random_requests(10, 32, 16, 0.0, seed=0, maker=ids)
    assert all(len(q.prompt) == 32 and q.output_len == 16 for q in fixed)
    assert all(100 <= t < 1000 and t != 500 for q in fixed for t in q.prompt)

    pre = prefix_requests(3, 4, 16, 4, 8, seed=1, maker=ids)
    assert len(pre) == 12 and all(len(q.prompt) == 20 for q in pre)
    prefixes = [tuple(q.prompt[:16]) for q in pre]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert prefixes != sorted(prefixes, key=prefixes.index)  # shuffled, not grouped


def test_sharegpt_loader(tmp_path):
    def conv(human: str, gpt: str) -> dict:
        return {"conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": human},
                                  {"from": "gpt", "value": gpt}]}

    entries = [conv("tell me about the sea and the sky", "the sea is wide and the sky is blue " * 3),
               conv("hi", "hello there my friend, how are you"),  # prompt too short
               conv("what is the answer to this question", "no"),  # reply too short
               conv("word " * 2000, "a long prompt is skipped " * 2),
               {"conversations": [{"from": "human", "value": "no reply here at all"}]},
               conv("write a long story about a dragon please", "once upon a time " * 10)]
    as_json = tmp_path / "chats.json"
    as_json.write_text(json.dumps(entries))
    as_jsonl = tmp_path / "chats.jsonl"
    as_jsonl.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    for path in (as_json, as_jsonl):
        reqs = load_sharegpt(path, 10, seed=0)
        assert sorted(q.prompt for q in reqs) == ["tell me about the sea and the sky",
                                                  "write a long story about a dragon please"]
        by_prompt = {q.prompt: q for q in reqs}
        assert by_prompt["tell me about the sea and the sky"].output_len == round(27 * 1.3)
        assert by_prompt["write a long story about a dragon please"].output_len == round(40 * 1.3)
    assert len(load_sharegpt(as_json, 1, seed=0)) == 1

"""Prompt logprobs through every service on the default model in float32, against transformers'
forward pass over the same weights: completions' echo + logprobs (the legacy logprobs object over
prompt then completion), vLLM's prompt_logprobs, max_tokens 0, streaming, a prompt the prefix
cache holds, prefill in chunks (max_num_batched_tokens 8), vLLM's --max-logprobs (30 here); then lm-evaluation-harness's
`local-completions` on a small local loglikelihood task, whose accuracy must be transformers'."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from service_stack import scheduler_stats

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parent.parent / "data" / "lm_eval"
TEXT = "The capital of France is Paris, and the capital of Germany is Berlin. Both are large cities."


@pytest.fixture(scope="module")
def stack(default_model_path, launch_stack):
    return launch_stack(default_model_path, kv_cache_memory="64MiB", max_num_batched_tokens=8, max_logprobs=30)


@pytest.fixture(scope="module")
def hf(default_model_path, default_model_hf):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(default_model_path), default_model_hf


def log_dist(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the log-distribution that predicts ids[i + 1] (the last row: the next)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def prompt_reference(model, ids: list[int]) -> list[float]:
    dist = log_dist(model, ids)
    return dist[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()


def test_echo_logprobs_match_transformers_with_and_without_a_cached_prefix(stack, client, model_name, hf):
    tokenizer, model = hf
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) > 8  # prefilled in chunks
    want = prompt_reference(model, ids)
    dist = log_dist(model, ids)
    client.completions.create(model=model_name, prompt=TEXT, max_tokens=1, temperature=0)  # fills the cache
    hits = scheduler_stats(stack).prefix_cache_hits
    client.completions.create(model=model_name, prompt=TEXT, max_tokens=1, temperature=0)
    assert scheduler_stats(stack).prefix_cache_hits > hits  # a plain request does hit it
    for _ in range(2):
        hits = scheduler_stats(stack).prefix_cache_hits
        out = client.completions.create(model=model_name, prompt=TEXT, echo=True, logprobs=3, max_tokens=0,
                                        temperature=0)
        assert scheduler_stats(stack).prefix_cache_hits == hits  # computed again: a cached prefix has no logits
        (choice,) = out.choices
        assert choice.text == TEXT and choice.finish_reason == "length" and out.usage.completion_tokens == 0
        lp = choice.logprobs
        assert lp.tokens == [tokenizer.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) < 1e-3
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
        for i, top in enumerate(lp.top_logprobs[1:]):
            best = dist[i].topk(3)
            assert {tokenizer.decode([t]) for t in best.indices.tolist()} <= set(top)
            assert abs(max(top.values()) - best.values[0].item()) < 1e-3


def test_lm_eval_request_shape_token_ids_echo_and_one_token(client, model_name, hf):
    tokenizer, model = hf
    ids = tokenizer("Question: What do bees make?\nAnswer: honey")["input_ids"]
    out = client.completions.create(model=model_name, prompt=[ids], echo=True, logprobs=1, max_tokens=1,
                                    temperature=0, seed=1234)
    (choice,) = out.choices
    dist = log_dist(model, ids)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:-1], prompt_reference(model, ids))) < 1e-3
    next_id = int(dist[-1].argmax())
    assert lp.tokens[-1] == tokenizer.decode([next_id]) and abs(lp.token_logprobs[-1] - dist[-1].max().item()) < 1e-3
    assert choice.text == tokenizer.decode(ids) + tokenizer.decode([next_id])


def test_vllm_prompt_logprobs_and_streaming_echo(client, model_name, hf):
    tokenizer, model = hf
    ids = tokenizer(TEXT)["input_ids"]
    want = prompt_reference(model, ids)
    dist = log_dist(model, ids)
    out = client.completions.create(model=model_name, prompt=TEXT, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    (choice,) = out.choices
    assert choice.logprobs is None
    prompt = choice.model_extra["prompt_logprobs"]
    assert len(prompt) == len(ids) and prompt[0] is None
    for i, (position, token) in enumerate(zip(prompt[1:], ids[1:])):
        entry = position[str(token)]
        assert abs(entry["logprob"] - want[i]) < 1e-3 and entry["decoded_token"] == tokenizer.decode([token])
        assert entry["rank"] == int((dist[i] >= dist[i, token]).sum())
        top = dist[i].topk(2).indices.tolist()
        assert [position[str(t)]["rank"] for t in top if t != token or entry["rank"] <= 2][:1] == [1]
        assert set(map(str, top)) <= set(position) and len(position) <= 3
    # Streaming echo + logprobs: the prompt's text goes out with its logprobs, then the tokens.
    chunks = list(client.completions.create(model=model_name, prompt=TEXT, echo=True, logprobs=0, max_tokens=3,
                                            temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens, logprobs, offsets = [], [], []
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            tokens += c.choices[0].logprobs.tokens
            logprobs += c.choices[0].logprobs.token_logprobs
            offsets += c.choices[0].logprobs.text_offset
    whole = client.completions.create(model=model_name, prompt=TEXT, echo=True, logprobs=0, max_tokens=3,
                                      temperature=0)
    assert text == whole.choices[0].text and text.startswith(TEXT)
    assert tokens == whole.choices[0].logprobs.tokens and len(tokens) == len(ids) + 3
    assert logprobs[0] is None and max(abs(a - b) for a, b in zip(logprobs[1:len(ids)], want)) < 1e-3
    assert offsets == whole.choices[0].logprobs.text_offset


def test_max_logprobs_bounds_every_way_of_asking(stack, client, model_name, hf):
    """--max-logprobs 30 (the scheduler's setting; the gateway reads it from the model info): 30 top
    logprobs come back and equal transformers' top 30; 31 is a 400 naming the field on chat,
    completions and prompt logprobs, and INVALID_ARGUMENT on the gRPC API."""
    import grpc
    import openai

    from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
    tokenizer, model = hf
    messages = [{"role": "user", "content": TEXT}]
    out = client.completions.create(model=model_name, prompt=TEXT, max_tokens=1, temperature=0, logprobs=30)
    (top,) = out.choices[0].logprobs.top_logprobs
    want = log_dist(model, tokenizer(TEXT)["input_ids"])[-1].topk(30).values.tolist()
    assert len(top) == 30 and max(abs(got - w) for got, w in zip(sorted(top.values(), reverse=True), want)) < 1e-3
    for call, field in ((lambda: client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=1, logprobs=True, top_logprobs=31), "top_logprobs"),
            (lambda: client.completions.create(model=model_name, prompt=TEXT, max_tokens=1, logprobs=31), "logprobs"),
            (lambda: client.completions.create(model=model_name, prompt=TEXT, max_tokens=1,
                                               extra_body={"prompt_logprobs": 31}), "prompt_logprobs")):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        error = info.value.body
        assert error["param"] == field and "at most 30" in error["message"], error
    with grpc.insecure_channel(stack.grpc_address) as channel, pytest.raises(grpc.RpcError) as refused:
        list(generate_pb2_grpc.GenerationStub(channel).Generate(generate_pb2.GenerateRequest(
            prompt=TEXT, params=common_pb2.SamplingParams(max_tokens=1, logprobs=31)), timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs 31" in refused.value.details()


def test_a_one_token_prompt_is_echoed_with_its_entry(client, model_name, hf):
    """Nothing predicts a one-token prompt's token, so the scheduler has no prompt logprob to send:
    its one entry (the token, logprob None) still comes first, streamed or not, as vLLM's."""
    tokenizer, model = hf
    (token,) = tokenizer("Hello")["input_ids"]
    first = log_dist(model, [token])[0].max().item()
    for max_tokens in (0, 2):
        out = client.completions.create(model=model_name, prompt=[token], echo=True, logprobs=1,
                                        max_tokens=max_tokens, temperature=0, extra_body={"prompt_logprobs": 1})
        (choice,) = out.choices
        assert choice.logprobs.tokens[0] == "Hello" and choice.logprobs.token_logprobs[0] is None
        assert len(choice.logprobs.tokens) == 1 + max_tokens and choice.text.startswith("Hello")
        assert choice.prompt_logprobs == [None]
        if max_tokens:
            assert abs(choice.logprobs.token_logprobs[1] - first) < 1e-3
        chunks = list(client.completions.create(model=model_name, prompt=[token], echo=True, logprobs=1,
                                                max_tokens=max_tokens, temperature=0, stream=True))
        tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
        assert tokens == choice.logprobs.tokens and "".join(c.choices[0].text for c in chunks) == choice.text


def test_every_choice_of_n_shows_the_prompt_logprobs_sent_once(client, model_name, hf):
    """Issue 42 row 3: the prompt's logprobs travel once per request (with sample 0's first
    delta); each of n choices still shows them, whole and streamed, echoed and in vLLM's field."""
    tokenizer, model = hf
    ids = tokenizer(TEXT)["input_ids"]
    want = prompt_reference(model, ids)
    args = dict(model=model_name, prompt=TEXT, n=3, max_tokens=2, temperature=1.0, seed=7, echo=True, logprobs=0,
                extra_body={"prompt_logprobs": 1})
    out = client.completions.create(**args)
    assert len(out.choices) == 3
    streamed: dict[int, list] = {}
    prompts: dict[int, list] = {}
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
            if (c.model_extra or {}).get("prompt_logprobs") is not None:
                assert c.index not in prompts  # once per choice, with its first chunk
                prompts[c.index] = c.model_extra["prompt_logprobs"]
    first = out.choices[0].model_extra["prompt_logprobs"]
    assert len(first) == len(ids) and first[0] is None
    for choice in out.choices:
        assert choice.text.startswith(TEXT) and choice.model_extra["prompt_logprobs"] == first
        got = choice.logprobs.token_logprobs[:len(ids)]
        assert got[0] is None and max(abs(a - b) for a, b in zip(got[1:], want)) < 1e-3
    assert sorted(prompts) == sorted(streamed) == [0, 1, 2] and all(p == first for p in prompts.values())
    for logprobs in streamed.values():
        assert logprobs[0] is None and max(abs(a - b) for a, b in zip(logprobs[1:len(ids)], want)) < 1e-3


def test_lm_eval_local_completions_accuracy_equals_transformers(stack, model_name, hf, default_model_path,
                                                                monkeypatch):
    import json

    import lm_eval  # the test extra has it
    from lm_eval.tasks import TaskManager

    tokenizer, model = hf
    docs = [json.loads(line) for line in (DATA / "tiny_qa.jsonl").read_text().splitlines()]
    # The reference: lm-eval's own request layout (context "Question: ...\nAnswer:", continuation
    # " " + choice, split after encoding the whole), scored by transformers.
    correct, expected_scores = 0, []
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"
        scores = []
        for choice in doc["choices"]:
            ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
            whole = tokenizer(context + " " + choice, add_special_tokens=False)["input_ids"]
            dist = log_dist(model, whole)
            scores.append(sum(dist[i - 1, whole[i]].item() for i in range(len(ctx), len(whole))))
        expected_scores.append(scores)
        correct += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    monkeypatch.chdir(DATA)  # the task's data_files path is relative
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(Path(os.environ.get("TMPDIR", "/tmp")) / "pagedserve-lm-eval"))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": model_name, "base_url": stack.http_url + "/v1/completions",
                    "tokenizer": str(default_model_path), "tokenizer_backend": "huggingface",
                    "tokenized_requests": True, "num_concurrent": 2, "max_retries": 1},
        tasks=["pagedserve_tiny_qa"], task_manager=TaskManager(include_path=str(DATA)), log_samples=True)
    acc = results["results"]["pagedserve_tiny_qa"]["acc,none"]
    assert acc == pytest.approx(correct / len(docs))
    samples = sorted(results["samples"]["pagedserve_tiny_qa"], key=lambda s: s["doc_id"])
    assert len(samples) == len(docs)
    for sample, scores in zip(samples, expected_scores):
        got = [resp[0][0] for resp in sample["resps"]]
        assert len(got) == len(scores) and got == pytest.approx(scores, abs=5e-3)
    print(f"lm-eval acc {acc:.3f} = transformers' {correct}/{len(docs)}")


def test_chat_prompt_logprobs_cover_the_templated_prompt(stack, client, model_name, hf):
    import httpx

    tokenizer, model = hf
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = httpx.post(stack.http_url + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    out = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1, temperature=0,
                                         extra_body={"prompt_logprobs": 0})
    prompt = out.model_extra["prompt_logprobs"]
    assert len(prompt) == len(ids) and prompt[0] is None
    got = [position[str(token)]["logprob"] for position, token in zip(prompt[1:], ids[1:])]
    assert max(abs(a - b) for a, b in zip(got, prompt_reference(model, ids))) < 1e-3

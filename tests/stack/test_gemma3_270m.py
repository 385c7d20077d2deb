"""Gemma 3 270M from its Q4_K_M GGUF (`pagedserve download --model gemma3-270m`), dequantized, in
float32: greedy tokens on six chat prompts (rendered with the Gemma 3 template that the preparation
ships) equal transformers' Gemma3ForCausalLM reading the same GGUF. Every prompt is longer than the
512-token sliding window, so local layers drop keys; the prompts are prefilled in chunks of 128 and
the KV pool holds about two of them, so requests are preempted and recomputed. Three paths: the
in-process engine, `pagedserve generate` and `pagedserve serve` (chat completions over HTTP)."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagedserve.common.sampling_params import SamplingParams
from service_stack import scheduler_stats, start_test_stack
from tiny_models import make_engine

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # ~10-35 min on 2 cores: `make test-heavy`

MAX_NEW = 8
CHUNK = 128
# 18 layers x (K, V) x 1 KV head x 256 x float32 = 36 KiB a token; 80 blocks of 16 hold two prompts.
KV_MEMORY = str(80 * 16 * 18 * 2 * 256 * 4)


def _numbers(a, b, step=1):
    return ", ".join(str(i) for i in range(a, b, step))


CHATS = [
    [{"role": "user", "content": f"Continue this list of numbers: {_numbers(1, 135)}"}],
    [{"role": "system", "content": "You are a careful assistant."},
     {"role": "user", "content": f"What is the largest number here? {_numbers(300, 420)}"}],
    [{"role": "user", "content": "Summarise this story in one line. " + " ".join(
        f"On day {i} the fox walked to the river, saw a heron and went back home." for i in range(1, 30))}],
    [{"role": "user", "content": "Name the colours in this list: " + ", ".join(
        ["red", "green", "blue", "yellow", "purple", "orange"] * 45)}],
    [{"role": "user", "content": f"Count backwards from 160: {_numbers(160, 30, -1)}"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Repeat after me: " + " ".join(f"word{i}" for i in range(175))}],
]


@pytest.fixture(scope="module")
def gemma_path():
    from pagedserve.model_files.default_model import ensure_named_model
    return ensure_named_model("gemma3-270m", progress=False)


@pytest.fixture(scope="module")
def tokenizer(gemma_path):
    from pagedserve.model_files.tokenizer_files import load_tokenizer
    return load_tokenizer(gemma_path)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from pagedserve.model_files.chat_templates import chat_token_ids
    ids = [chat_token_ids(tokenizer, chat)[0] for chat in CHATS]
    assert min(len(p) for p in ids) > 512  # past the sliding window
    return ids


@pytest.fixture(scope="module")
def expected(gemma_path, prompts):
    """transformers' greedy tokens, its own GGUF reader dequantizing the same file."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(gemma_path, gguf_file="model.gguf",
                                                              dtype=torch.float32)
    assert model.config.sliding_window == 512
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


def test_engine_chunked_and_preempted(gemma_path, prompts, expected):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with make_engine(gemma_path, max_num_batched_tokens=CHUNK, kv_cache_memory=KV_MEMORY) as engine:
        got = [samples[0].token_ids for samples in engine.generate(prompts, params)]
        assert engine.stats()["num_preemptions"] > 0
    assert got == expected


def test_generate_command(gemma_path, tmp_path, expected):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"messages": chat, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
                           + "\n" for chat in CHATS))
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "generate", "--model", "gemma3-270m",
                           "--dtype", "float32", "--quantization", "none", "--max-num-batched-tokens", str(CHUNK),
                           "--kv-cache-memory",
                           KV_MEMORY, "--prompts-file", str(src), "--output", str(dst)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["outputs"][0]["token_ids"] for o in out] == expected


def test_serve_chat_completions(gemma_path, tokenizer, expected, tmp_path):
    import openai

    stack = start_test_stack(gemma_path, tmp_path, max_num_batched_tokens=CHUNK, kv_cache_memory=KV_MEMORY)
    try:
        client = openai.OpenAI(base_url=stack.addresses["http"] + "/v1", api_key="unused", max_retries=0,
                               timeout=1200)
        name = client.models.list().data[0].id

        def ask(chat):
            reply = client.chat.completions.create(model=name, messages=chat, temperature=0, max_tokens=MAX_NEW,
                                                   extra_body={"ignore_eos": True})
            return reply.choices[0].message.content

        with ThreadPoolExecutor(len(CHATS)) as pool:  # all at once: they do not fit the pool together
            texts = list(pool.map(ask, CHATS))
        assert texts == [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in expected]
        assert scheduler_stats(stack).num_preemptions > 0
    finally:
        stack.stop()

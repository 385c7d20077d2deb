"""Helpers of the end-to-end tests: the real services as processes on free ports, a Redis key
prefix per stack, a tiny model that carries the default model's tokenizer, gRPC stats, and the
`openai` SDK's chats with images checked against transformers' answers."""

from __future__ import annotations

import base64
import os
import shutil
import time
import uuid
from pathlib import Path

import grpc
import httpx

from pagedserve.common.grpc_util import free_port
from pagedserve.launcher.processes import ServiceProcess, StackConfig, start_stack
from pagedserve.v1 import scheduler_pb2, scheduler_pb2_grpc

REDIS_URL = "redis://127.0.0.1:6379/0"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def tiny_model_with_tokenizer(folder: Path, default_model: Path, arch: str = "llama") -> Path:
    """A tiny random model (Llama unless told) whose vocabulary is the default model's, with its
    tokenizer files."""
    from tiny_models import build_tiny_model

    build_tiny_model(folder, arch, vocab_size=49152, max_position_embeddings=1024, bos_token_id=1,
                     eos_token_id=2, pad_token_id=2)
    for name in TOKENIZER_FILES:
        if (default_model / name).exists():
            shutil.copy(default_model / name, folder / name)
    return folder


def bigram_chain_model(folder: Path, default_model: Path, chain_text: str, after_prompt: str) -> list[int]:
    """A tiny model (tiny_model_with_tokenizer's) that greedily writes chain_text after any prompt
    ending like after_prompt: every layer's output projections zeroed, the next token depends on
    the current one only (its embedding, normed, through the head), and the head maps each token of
    the chain to the next. Returns the chain's token ids (distinct, the start token included)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    import torch

    tiny_model_with_tokenizer(folder, default_model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    start = tokenizer(after_prompt, add_special_tokens=False)["input_ids"][-1]
    chain = [start, *tokenizer(chain_text, add_special_tokens=False)["input_ids"]]
    assert len(set(chain)) == len(chain), "the chain's tokens must be distinct"
    weights = load_file(folder / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name].zero_()
    embed = weights["model.embed_tokens.weight"]
    head = torch.randn_like(weights["lm_head.weight"]) * 1e-3
    for current, following in zip(chain, chain[1:]):
        head[following] = 40.0 * embed[current] / embed[current].norm()
    weights["lm_head.weight"] = head
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return chain


def start_test_stack(model: Path, log_dir: Path, **overrides):
    """Every service as a real process; records under a fresh Redis key prefix."""
    prefix = f"pstest-{uuid.uuid4().hex[:8]}:"
    env = {**os.environ, "PAGEDSERVE_REDIS_PREFIX": prefix}
    settings = dict(model=str(model), port=free_port(), grpc_port=free_port(), redis_url=REDIS_URL,
                    dtype="float32", quantization="none", kv_cache_memory="256MiB", log_dir=str(log_dir), env=env,
                    startup_timeout=300)
    cfg = StackConfig(**{**settings, **overrides})
    stack = start_stack(cfg)
    stack.redis_prefix = prefix
    return stack


def scheduler_stats(stack) -> scheduler_pb2.SchedulerStats:
    with grpc.insecure_channel(stack.addresses["scheduler"]) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.StatsRequest(), timeout=10)


def wait_until_idle(stack, timeout_s: float = 30.0) -> scheduler_pb2.SchedulerStats:
    """Until nothing runs or waits and every KV block is free again (cached prefixes count as free)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = scheduler_stats(stack)
        if stats.num_running == stats.num_waiting == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def restart(stack, name: str, kill_signal: int) -> ServiceProcess:
    """Kill one service and start it again with the same command line; wait until healthy."""
    old = next(p for p in stack.processes if p.name == name)
    old.signal(kill_signal)
    old.proc.wait(timeout=30)
    old.stop()  # reaps it and closes its log file
    new = ServiceProcess(name, old.argv, old.health_address, env=old.env, log_path=old.log_path)
    new.health_internal = old.health_internal
    new.start()
    stack.processes[stack.processes.index(old)] = new
    new.wait_healthy(300)
    return new


def extra_gateway(stack, log_dir, auth: dict[str, str], *flags: str) -> tuple[ServiceProcess, str]:
    """Another gateway on the same stack (same services, same Redis), on its own ports; auth: the headers
    its /v1/models answers to (it is up when it does)."""
    base = next(p for p in stack.processes if p.name == "gateway")
    argv, port, grpc_port = list(base.argv), free_port(), free_port()
    argv[argv.index("--port") + 1], argv[argv.index("--grpc-port") + 1] = str(port), str(grpc_port)
    proc = ServiceProcess("gateway", argv + list(flags), f"127.0.0.1:{grpc_port}", env=base.env,
                          log_path=log_dir / f"gateway-{port}.log").start()
    proc.wait_healthy(120)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/v1/models", headers=auth, timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the extra gateway never answered"
        time.sleep(0.1)


def data_url(data: bytes) -> str:
    """A PNG's bytes as a data: URL."""
    return "data:image/png;base64," + base64.b64encode(data).decode()


def ask_with_images(client, question: str, max_tokens: int, *urls: str):
    """The `openai` client's greedy chat completion (ignore_eos) of one user turn: the images' URLs, then the
    question."""
    return client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=max_tokens, temperature=0.0,
        extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": url}} for url in urls),
                                               {"type": "text", "text": question}]}])


def check_image_answers(client, reference, images: list[bytes]) -> list[str]:
    """Each image alone with the question of reference (tiny_llava.VisionReference) through the `openai` client:
    the answer and usage.prompt_tokens are transformers'. Returns the answers."""
    answers = []
    for image in images:
        answer = ask_with_images(client, reference.question, reference.max_tokens, data_url(image))
        want, prompt_tokens = reference(image)
        assert answer.choices[0].message.content == want
        assert answer.usage.prompt_tokens == prompt_tokens
        answers.append(want)
    return answers


def check_two_images_in_one_message(client, reference, first: bytes, second: bytes) -> None:
    """Two images then the question in one message through the `openai` client: the answer and
    usage.prompt_tokens are transformers' on the same chat (reference.chat)."""
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": reference.question}]
    _, want, length = reference.chat(content, [first, second])
    answer = ask_with_images(client, reference.question, reference.max_tokens, data_url(first), data_url(second))
    assert answer.choices[0].message.content == want
    assert answer.usage.prompt_tokens == length

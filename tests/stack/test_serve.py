"""`pagedserve serve` as a real process: every service on loopback, a completion over HTTP, Ctrl-C."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from pagedserve.common.grpc_util import free_port

BANNER = re.compile(r"pagedserve: OpenAI API at (http://\S+)/v1 \(model (\S+)\), gRPC at (\S+)")


def start_serve(tmp_path: Path, *flags: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_") or k == "PAGEDSERVE_DATA_DIR"}
    return subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "serve", "--log-dir", str(tmp_path / "logs"),
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def children(pid: int) -> list[int]:
    """Child processes of every thread of pid (the supervisor thread starts the restarted ones)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), pid


@contextlib.contextmanager
def killed_at_exit(proc: subprocess.Popen):
    """Whatever the test asserted, the launcher does not outlive it."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_banner(proc: subprocess.Popen, timeout_s: float = 600) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if match := BANNER.search(line):
            return match
    proc.kill()
    out, err = proc.communicate(timeout=30)
    pytest.fail(f"no banner (exit {proc.returncode}):\n{out}\n{err[-4000:]}")


def test_a_service_that_fails_to_start_stops_the_launcher(tmp_path):
    # config.json and the weight file's header pass serve's own checks; the tensor in it is none the
    # model has, which only the worker finds.
    from safetensors.torch import save_file
    import torch
    model = tmp_path / "broken-weights"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)))
    save_file({"junk": torch.zeros(1)}, model / "model.safetensors")
    proc = start_serve(tmp_path, "--model", str(model), "--port", str(free_port()),
                       "--grpc-port", str(free_port()), "--redis-url", "memory")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    assert "worker0" in err and "exit code" in err and "the checkpoint lacks weights" in err
    assert (tmp_path / "logs" / "worker0.log").exists()


def test_a_model_that_is_not_there_fails_before_any_service_starts(tmp_path):
    proc = start_serve(tmp_path, "--model", str(tmp_path / "no-such-model"), "--port", str(free_port()),
                       "--grpc-port", str(free_port()), "--redis-url", "memory")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert "pagedserve serve: model not found" in err and "no-such-model" in err
    assert not (tmp_path / "logs" / "worker0.log").exists()


@pytest.mark.slow
def test_serve_answers_then_stops_on_ctrl_c(tmp_path, default_model_path):
    port, grpc_port = free_port(), free_port()
    proc = start_serve(tmp_path, "--port", str(port), "--grpc-port", str(grpc_port), "--max-num-seqs", "8")
    with killed_at_exit(proc):
        url, model, grpc_address = wait_banner(proc).groups()
        assert url == f"http://127.0.0.1:{port}" and grpc_address == f"127.0.0.1:{grpc_port}"
        body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8,
                           "temperature": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.load(reply)
        assert answer["choices"][0]["text"].strip(), answer
        kids = children(proc.pid)
        assert len(kids) >= 4  # worker, scheduler, tokenizer, gateway (and redis when installed)
        if shutil.which("redis-server"):
            check_private_redis(proc.pid, kids)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-4000:]
        assert_gone(kids)


def check_private_redis(launcher_pid: int, kids: list[int]) -> None:
    """The private Redis has a maxmemory and a password; the scheduler got its URL by environment;
    the password is on no command line (`ps` shows those to every user)."""
    import redis

    scheduler = next(p for p in kids if b"\0scheduler\0" in Path(f"/proc/{p}/cmdline").read_bytes())
    environ = dict(item.split(b"=", 1) for item in Path(f"/proc/{scheduler}/environ").read_bytes().split(b"\0") if item)
    url = environ[b"PAGEDSERVE_REDIS_URL"].decode()
    password = urlsplit(url).password
    assert password and len(password) >= 32
    for pid in [launcher_pid, *kids]:
        assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    client = redis.Redis.from_url(url, decode_responses=True)
    assert int(client.config_get("maxmemory")["maxmemory"]) > 0
    client.close()


def tokenizer_pids(launcher_pid: int) -> list[int]:
    return [pid for pid in children(launcher_pid) if b"\0tokenizer\0" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.mark.slow
def test_a_killed_service_is_restarted_and_serving_goes_on(tmp_path, default_model_path):
    """The default supervisor (--max-restarts 5) starts a SIGKILLed tokenizer again."""
    port = free_port()
    proc = start_serve(tmp_path, "--port", str(port), "--grpc-port", str(free_port()))
    with killed_at_exit(proc):
        url, model, _ = wait_banner(proc).groups()
        [old] = tokenizer_pids(proc.pid)
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 180
        answer, last_error = None, None
        while time.monotonic() < deadline and answer is None:
            time.sleep(0.5)
            if [pid for pid in tokenizer_pids(proc.pid) if pid != old]:
                body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
                request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=30) as reply:
                        answer = json.load(reply)
                except OSError as exc:  # the new tokenizer is still starting
                    last_error = exc.read().decode() if hasattr(exc, "read") else repr(exc)
        assert answer is not None, (last_error, tokenizer_pids(proc.pid))
        assert answer["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-4000:]
        assert "restart" in err.lower()


@pytest.mark.slow
def test_a_service_that_dies_stops_everything_without_restarts(tmp_path, default_model_path):
    proc = start_serve(tmp_path, "--port", str(free_port()), "--grpc-port", str(free_port()), "--max-restarts", "0")
    with killed_at_exit(proc):
        wait_banner(proc)
        kids = children(proc.pid)
        tokenizer = [pid for pid in kids if b"\0tokenizer\0" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(tokenizer) == 1
        os.kill(tokenizer[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1
        assert "tokenizer stopped unexpectedly (killed by SIGKILL)" in err
        assert_gone(kids)


@pytest.mark.slow
def test_sigterm_during_startup_stops_cleanly(tmp_path, default_model_path):
    proc = start_serve(tmp_path, "--port", str(free_port()), "--grpc-port", str(free_port()))
    with killed_at_exit(proc):
        deadline = time.monotonic() + 60
        while not (tmp_path / "logs" / "worker0.log").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        kids = children(proc.pid)
        assert kids
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-4000:]
        assert "OpenAI API" not in out
        assert_gone(kids)

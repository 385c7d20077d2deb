"""Shared fixtures: tiny random-weight models saved as safetensors, the default model and its
tokenizer, TLS certificates. The tests that start the services as processes live in tests/stack/
(its conftest.py adds their fixtures). Helpers are modules here (tiny_models, service_stack,
fake_workers, ...), importable from both folders; a conftest.py is no module to import from (there
are two)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _one_of_several_workers(worker: str, count: int) -> None:
    """`make test` runs the suite in several pytest-xdist processes (TEST_WORKERS, two). Each keeps torch
    (and the services it starts) to one thread, or two processes' thread pools spin against each other on
    the same cores: numbers are compared within a process, so every reference computes with the same
    threads as what it is compared with. Each picks its services' ports from a range of its own
    (PAGEDSERVE_PORT_RANGE, grpc_util.free_port), so two stacks starting at once never pick the same one."""
    from pagedserve.common.grpc_util import PORT_RANGE_ENV, port_range

    os.environ["OMP_NUM_THREADS"] = os.environ.get("PAGEDSERVE_TEST_THREADS", "1")
    low, high = port_range() or (10000, 32768)
    index, share = int(worker.removeprefix("gw")), (high - low) // count
    os.environ[PORT_RANGE_ENV] = f"{low + index * share}-{low + (index + 1) * share}"


if os.environ.get("PYTEST_XDIST_WORKER"):
    _one_of_several_workers(os.environ["PYTEST_XDIST_WORKER"], int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from pagedserve.model_files.default_model import ensure_default_model
    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def default_model_hf(default_model_path, tmp_path_factory):
    """transformers' float32 model of the default model's GGUF, the reference the slow tests compare
    with: loaded once a session (dequantizing the GGUF takes ~13 s), from a folder of its own so our
    config.json cannot leak into it. Tests only run it (eval mode, no gradients), never change it."""
    import torch
    import transformers

    ref_dir = tmp_path_factory.mktemp("default-model-hf")
    (ref_dir / "model.gguf").symlink_to(default_model_path / "model.gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, gguf_file="model.gguf", dtype=torch.float32)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's own HF tokenizer."""
    from transformers import AutoTokenizer

    from pagedserve.model_files.default_model import resolve_model
    return AutoTokenizer.from_pretrained(resolve_model(None))


def make_certificates(folder: Path, name: str) -> dict[str, str]:
    """A CA and one certificate it signed for 127.0.0.1 / localhost, usable by servers and clients."""
    from pagedserve.common.grpc_util import TLS_ENV

    def run(*argv: str) -> None:
        subprocess.run(["openssl", *argv], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.pem",
        "-days", "2", "-subj", f"/CN={name} test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
        "-subj", "/CN=127.0.0.1")
    (folder / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                        "extendedKeyUsage=serverAuth,clientAuth\n")
    run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{name}-ca.pem", "-CAkey", f"{name}-ca.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return {TLS_ENV["cert"]: str(folder / f"{name}.pem"), TLS_ENV["key"]: str(folder / f"{name}.key"),
            TLS_ENV["ca"]: str(folder / f"{name}-ca.pem")}


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> dict[str, dict[str, str]]:
    """Two CAs, each with a certificate it signed: "ours" (the services') and "rogue" (a stranger's)."""
    folder = tmp_path_factory.mktemp("tls")
    return {"ours": make_certificates(folder, "ours"), "rogue": make_certificates(folder, "rogue")}


# ---- heavy tests: realism the 20-minute suite cannot afford ----------------------------------
REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def redis_prefix():
    """A fresh key prefix in the Redis at 127.0.0.1:6379 (skipped when none answers), its keys deleted after."""
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    import uuid
    name = f"pstest-{uuid.uuid4().hex[:8]}:"
    yield name
    keys = list(client.scan_iter(name + "*"))
    if keys:
        client.delete(*keys)


# A test marked `heavy` (Gemma 3 270M in float32 against transformers: ~10-35 min on 2 cores)
# runs with `make test-heavy` (PAGEDSERVE_HEAVY_TESTS=1) and is skipped, saying so, otherwise.
def pytest_collection_modifyitems(config, items):
    import os
    if os.environ.get("PAGEDSERVE_HEAVY_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="heavy: run with `make test-heavy` (PAGEDSERVE_HEAVY_TESTS=1)")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip)

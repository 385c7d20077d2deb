"""Shared fixtures: tiny random-weight models saved as safetensors, and the default model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_tiny_model  # noqa: E402


class NoTokenizer:
    """Tiny test models have no tokenizer; the engine only needs its eos id."""
    eos_token_id = None


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


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's own HF tokenizer."""
    from transformers import AutoTokenizer

    from pagedserve.model_files.default_model import resolve_model
    return AutoTokenizer.from_pretrained(resolve_model(None))


NO_TOKENIZER = NoTokenizer()


def make_engine(model: Path, tokenizer=NO_TOKENIZER, **overrides):
    """A float32 engine on `model`; tokenizer=None loads the model's own."""
    from pagedserve.engine import EngineConfig, LLMEngine
    cfg = dict(model=str(model), dtype="float32", progress=False, kv_cache_memory="64MiB")
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg), tokenizer=tokenizer)

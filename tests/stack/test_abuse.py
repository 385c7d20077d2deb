"""Tenancy and abuse, round 2 (issue 42), against the real stack: real processes and Redis, two
API keys and an operator key, as tests/stack/test_tenancy.py. Each test is one row of the issue's
table (docs/security.md, "Round 2", numbered as in the issue): the attack as a client with an
ordinary key would try it, and what it gets now. The latency rows assert that B finishes within a
bound an idle stack meets with a wide margin (the ratio under attack / alone is measured for the
report, not asserted)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow  # the tiny model borrows the default model's tokenizer

K1, K2, ADMIN = "sk-abuse-one", "sk-abuse-two", "sk-abuse-operator"
SHARED = " ".join(f"secret{i}" for i in range(60))  # well over 64 tokens: several full blocks


@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    return launch_stack(tiny_model, api_key=[K1, K2], admin_api_key=[ADMIN], kv_cache_memory="32MiB")


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.http_url, timeout=120) as client:
        yield client


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def complete(http, key: str, prompt: str, **extra) -> dict:
    r = http.post("/v1/completions", headers=auth(key),
                  json={"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_prefix_cache_is_the_owners(http):
    """Row 5: key A sends S; key B sends S + " x" and read `cached_tokens`, block by block, to learn
    whether A sent S. Now the owner is in the first block's hash: B finds none of A's blocks, A
    finds its own (and vLLM's cache_salt splits one owner's cache further)."""
    complete(http, K1, SHARED)
    assert cached(complete(http, K2, SHARED + " x")) == 0
    assert cached(complete(http, K1, SHARED + " y")) >= 64
    complete(http, K2, "salted " + SHARED, cache_salt="tenant-a")
    assert cached(complete(http, K2, "salted " + SHARED + " x", cache_salt="tenant-b")) == 0
    assert cached(complete(http, K2, "salted " + SHARED + " y", cache_salt="tenant-a")) >= 64
    too_long = http.post("/v1/completions", headers=auth(K1),
                         json={"prompt": "hi", "max_tokens": 1, "cache_salt": "s" * 257})
    assert too_long.status_code == 400 and "cache_salt" in too_long.text

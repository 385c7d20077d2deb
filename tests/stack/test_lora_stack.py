"""LoRA adapters through the real stack (issue 40): the `openai` client selects an adapter by its
name as the model and gets transformers + PEFT's greedy text; /v1/models lists the adapters with
their parent; adapters load and unload at run time (REST and gRPC, the operator key only), for every
gateway of the stack; a bad
folder gets a clear 400/404, an adapter the worker cannot load a 400 naming why, and the others go
on; the metrics count per adapter."""

from __future__ import annotations

import re
import time

import grpc
import httpx
import openai
import pytest

from lora_adapters import build_adapter, merged_greedy
from pagedserve.gateway.lora_adapters import REFRESH_S
from pagedserve.v1 import generate_pb2, generate_pb2_grpc
from service_stack import extra_gateway
from tiny_models import build_tiny_model

pytestmark = pytest.mark.slow  # the tiny model borrows the default model's tokenizer

KEY, ADMIN = "sk-lora-user", "sk-lora-operator"
PROMPT = [504, 3458, 5694, 12345, 907, 42, 1999, 88]
MAX_NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-stack")
    folders = {"sql": build_adapter(tiny_model, root / "sql", seed=11, r=8),
               "chat": build_adapter(tiny_model, root / "chat", seed=12, r=16, rslora=True),
               "wide": build_adapter(tiny_model, root / "wide", seed=13, r=32),
               "alien": build_adapter(build_tiny_model(root / "other", "llama", hidden_size=32, intermediate_size=64,
                                                       vocab_size=49152), root / "alien", seed=14, r=4)}
    expected = {name: merged_greedy(tiny_model, folder, [PROMPT], MAX_NEW)[0] for name, folder in folders.items()
                if name != "alien"}
    expected[None] = merged_greedy(tiny_model, None, [PROMPT], MAX_NEW)[0]
    return folders, expected


@pytest.fixture(scope="module")
def stack(tiny_model, adapters, launch_stack):
    folders, _ = adapters
    return launch_stack(tiny_model, api_key=[KEY], admin_api_key=[ADMIN], enable_lora=True, max_loras=2,
                        max_lora_rank=16, lora_modules=[f"sql={folders['sql']}"], kv_cache_memory="32MiB")


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def tokens(client, model: str) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].logprobs.tokens


def text_of(tokenizer, ids):
    return [tokenizer.convert_ids_to_tokens(i) for i in ids]


def admin(stack, path: str, body: dict, key: str = ADMIN) -> httpx.Response:
    return httpx.post(stack.http_url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_adapters_by_name_equal_merged_transformers(stack, client, adapters, tokenizer):
    folders, expected = adapters
    models = {m.id: m for m in client.models.list().data}
    base = next(m for m in models.values() if m.parent is None).id
    assert models["sql"].parent == base and models["sql"].root == str(folders["sql"])
    got_sql, got_base = tokens(client, "sql"), tokens(client, base)
    assert got_sql != got_base
    assert len(got_sql) == MAX_NEW and got_sql == [tokenizer.decode([t]) for t in expected["sql"]]
    assert got_base == [tokenizer.decode([t]) for t in expected[None]]


def test_runtime_load_unload_and_bad_adapters(stack, client, adapters, tokenizer):
    folders, expected = adapters
    body = {"lora_name": "chat", "lora_path": str(folders["chat"])}
    assert admin(stack, "/v1/load_lora_adapter", body, key=KEY).status_code == 403  # an ordinary key
    missing = admin(stack, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/folder"})
    assert missing.status_code == 404 and "no folder" in missing.json()["error"]["message"]
    too_wide = admin(stack, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(folders["wide"])})
    assert too_wide.status_code == 400 and "--max-lora-rank 16" in too_wide.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", prompt=PROMPT, max_tokens=2)
    loaded = admin(stack, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200 and "added" in loaded.text
    assert admin(stack, "/v1/load_lora_adapter", body).status_code == 400  # twice
    assert tokens(client, "chat") == [tokenizer.decode([t]) for t in expected["chat"]]
    assert tokens(client, "sql") == [tokenizer.decode([t]) for t in expected["sql"]]  # the others go on
    assert admin(stack, "/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200
    assert admin(stack, "/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", prompt=PROMPT, max_tokens=2)
    # A folder of another model's shapes passes the gateway's checks; the worker cannot load it:
    # its request fails alone with a 400 naming the adapter and the module that does not fit
    # (streamed: an error event after the headers), the others go on.
    assert admin(stack, "/v1/load_lora_adapter", {"lora_name": "alien", "lora_path": str(folders["alien"])}) \
        .status_code == 200
    with pytest.raises(openai.BadRequestError, match=r"LoRA adapter 'alien' did not load: .*does not fit"):
        client.completions.create(model="alien", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.APIError, match=r"LoRA adapter 'alien' did not load"):
        list(client.completions.create(model="alien", prompt=PROMPT, max_tokens=2, stream=True))
    assert tokens(client, "sql") == [tokenizer.decode([t]) for t in expected["sql"]]
    stats = httpx.get(stack.http_url + "/v1/engine/stats", headers={"Authorization": f"Bearer {ADMIN}"},
                      timeout=30).json()
    assert {"sql", "chat", ""} <= {r["adapter"] for r in stats["recent_requests"]}
    metrics = httpx.get(stack.http_url + "/metrics", timeout=30).text
    assert re.search(r'pagedserve:adapter_requests_total\{adapter="chat",finished_reason="length"[^}]*\} 1', metrics)


def test_grpc_load_and_unload(stack, adapters):
    folders, _ = adapters
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        operator = (("authorization", f"Bearer {ADMIN}"),)
        request = generate_pb2.LoadLoraAdapterRequest(lora_name="chat2", lora_path=str(folders["chat"]))
        with pytest.raises(grpc.RpcError) as err:
            stub.LoadLoraAdapter(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=30)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "added" in stub.LoadLoraAdapter(request, metadata=operator, timeout=30).message
        gen = generate_pb2.GenerateRequest(model="chat2", prompt_token_ids=generate_pb2.TokenIds(ids=PROMPT))
        gen.params.max_tokens, gen.params.temperature = 2, 0
        replies = list(stub.Generate(gen, metadata=operator, timeout=120))
        assert replies[-1].finish_reason == "length"
        stub.UnloadLoraAdapter(generate_pb2.UnloadLoraAdapterRequest(lora_name="chat2"), metadata=operator, timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(gen, metadata=operator, timeout=60))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_adapter_loaded_through_one_gateway_is_served_by_every_gateway(stack, adapters, tokenizer, tmp_path):
    """Helm runs two gateways behind one Service: an adapter loaded through one must be served by the other
    (the registry is in the stack's Redis), named once, and unloaded for all."""
    folders, expected = adapters
    operator = {"Authorization": f"Bearer {ADMIN}"}
    gateway, url = extra_gateway(stack, tmp_path, operator)
    try:
        other = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        assert {"sql"} <= {m.id for m in other.models.list().data}  # --lora-modules: on both
        body = {"lora_name": "everywhere", "lora_path": str(folders["chat"])}
        assert admin(stack, "/v1/load_lora_adapter", body).status_code == 200
        assert tokens(other, "everywhere") == [tokenizer.decode([t]) for t in expected["chat"]]  # at once
        assert "everywhere" in {m.id for m in other.models.list().data}
        twice = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=operator, timeout=60)
        assert twice.status_code == 400 and "already been loaded" in twice.json()["error"]["message"]
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "everywhere"}, headers=operator,
                          timeout=60).status_code == 200
        assert admin(stack, "/v1/unload_lora_adapter", {"lora_name": "everywhere"}).status_code == 404
        time.sleep(REFRESH_S)  # the longest the first gateway may still serve it
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0).completions.create(
                model="everywhere", prompt=PROMPT, max_tokens=2)
    finally:
        gateway.stop()

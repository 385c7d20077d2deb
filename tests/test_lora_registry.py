"""The gateways' LoRA adapter registry (gateway/lora_adapters.py) against a real Redis (a fresh key prefix
per test): what one gateway loads every other serves from its next request on, a name is taken once for
all, an unload reaches the others within REFRESH_S, --lora-modules are published at start, and a Redis
that does not answer is a 503 for loads and unloads while requests go on with the last view. Without
Redis the registry is the gateway's own. The stack test (tests/stack/test_lora_stack.py) runs two gateway
processes over it."""

from __future__ import annotations

import asyncio
import time

import pytest

from lora_adapters import build_adapter
from pagedserve.common.lora import LoraError
from pagedserve.common.replicas import async_reader
from pagedserve.gateway.lora_adapters import REFRESH_S, LoraAdapters, SharedAdapters, as_request_error
from pagedserve.v1 import generate_pb2

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="module")
def folders(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-registry")
    return {name: str(build_adapter(tiny_llama, root / name, seed=seed, r=4))
            for name, seed in (("sql", 1), ("chat", 2))}


def gateway(prefix: str, modules: dict[str, str] | None = None, url: str = REDIS_URL) -> LoraAdapters:
    """One gateway's registry, with its own Redis client as each gateway process has."""
    return LoraAdapters(True, modules, 16, SharedAdapters(async_reader(url), prefix))


def stamped(adapters: LoraAdapters, model: str) -> tuple[str, str, str]:
    gen = generate_pb2.GenerateRequest(model=model)
    adapters.stamp(gen)
    return gen.model, gen.params.lora_name, gen.params.lora_path


def test_what_one_gateway_loads_every_gateway_serves(redis_prefix, folders):
    async def run():
        a, b = gateway(redis_prefix, {"sql": folders["sql"]}), gateway(redis_prefix)
        await a.publish()
        await b.publish()
        assert b.path_of("sql") == folders["sql"]  # a's --lora-modules, read when b started
        await a.load("chat", folders["chat"])
        assert b.path_of("chat") is None  # b's view is younger than REFRESH_S...
        await b.sync("chat")  # ...but a name it does not know is looked up at once
        assert stamped(b, "chat") == ("", "chat", folders["chat"])
        assert [c["id"] for c in b.model_cards("base", 2048, True)] == ["sql", "chat"]
        with pytest.raises(LoraError, match="already been loaded") as taken:
            await b.load("chat", folders["sql"])  # the name is the deployment's, taken once
        assert taken.value.status == 400
        await b.unload("chat")
        with pytest.raises(LoraError, match="cannot be found") as gone:
            await a.unload("chat")
        assert gone.value.status == 404
        assert b.path_of("chat") is None
        await asyncio.sleep(REFRESH_S)
        await a.sync()
        assert a.path_of("chat") is None and a.path_of("sql") == folders["sql"]  # a's own load, gone within REFRESH_S
        assert stamped(a, "chat") == ("chat", "", "")
    asyncio.run(run())


def test_a_view_is_read_again_at_most_every_refresh_interval(redis_prefix, folders):
    """A request for a known name costs no Redis read while the view is fresh; an unloaded one's other
    gateways stop serving it within REFRESH_S."""
    async def run():
        a, b = gateway(redis_prefix), gateway(redis_prefix)
        await a.publish()
        read_at = time.monotonic()
        await b.publish()  # b's whole view is read here
        await a.load("sql", folders["sql"])
        await b.sync("sql")
        await a.unload("sql")
        await b.sync("sql")
        if time.monotonic() - read_at < REFRESH_S:  # (a machine too slow for this says nothing here)
            assert b.path_of("sql") == folders["sql"]
        await asyncio.sleep(REFRESH_S)
        await b.sync("sql")
        assert b.path_of("sql") is None
    asyncio.run(run())


def test_redis_away_refuses_changes_with_503_and_keeps_the_view(redis_prefix, folders):
    async def run():
        away = gateway(redis_prefix, {"sql": folders["sql"]}, url="redis://127.0.0.1:1/0")
        await away.publish()  # logged: this gateway serves its own modules meanwhile
        assert away.path_of("sql") == folders["sql"]
        for change in (away.load("chat", folders["chat"]), away.unload("sql")):
            with pytest.raises(LoraError) as err:
                await change
            assert err.value.status == 503 and "Redis" in str(err.value)
            assert as_request_error(err.value).status == 503
        await away.sync("chat", force=True)
        assert away.path_of("sql") == folders["sql"] and away.path_of("chat") is None
    asyncio.run(run())


def test_without_redis_the_registry_is_the_gateways_own(folders):
    async def run():
        alone = LoraAdapters(True, {"sql": folders["sql"]}, 16)
        await alone.publish()
        await alone.sync("chat")
        with pytest.raises(LoraError, match="already been loaded"):
            await alone.load("sql", folders["chat"])
        await alone.load("chat", folders["chat"])
        assert alone.path_of("chat") == folders["chat"]
        await alone.unload("chat")
        with pytest.raises(LoraError, match="cannot be found"):
            await alone.unload("chat")
        with pytest.raises(LoraError, match="--enable-lora"):
            await LoraAdapters(False).load("chat", folders["chat"])
    asyncio.run(run())

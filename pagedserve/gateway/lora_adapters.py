"""The LoRA adapters this gateway serves (--enable-lora, --lora-modules; POST /v1/load_lora_adapter
and /v1/unload_lora_adapter, and their gRPC twins): a name -> PEFT folder registry.

A request names an adapter as its "model": `stamp` sets the request's lora_name and lora_path
(the worker reads the folder on first use, keyed by both) and forwards it under the served model;
a client's own lora_name / lora_path (gRPC) are never taken. A folder is checked when it is
registered (common/lora.read_adapter: files, target modules, ranks against --max-lora-rank), so a
bad one is refused there (404: no such folder; 400: not servable) and never reaches the engine.
Unloading refuses new requests of the adapter; running ones finish with it.

Several gateways of one deployment (Helm's gateway replicas, docs/scale-out.md) serve one set of
adapters: with Redis the registry is the hash `P lora_adapters` (SharedAdapters; no TTL), and each
gateway's `paths` is its view of it, re-read at most every REFRESH_S and at once for a name it does
not know (`sync`, awaited before a request's model is checked). An adapter loaded through one gateway
is served by every gateway from its next request on; one unloaded stays served by the others for at
most REFRESH_S. --lora-modules are written to the hash when a gateway starts (`publish`). Without
Redis the registry is this gateway's alone.

Adapters are the operator's: loading and unloading take the operator key (Caller.admin).
Event loop only.
"""

from __future__ import annotations

import logging
import time

from pagedserve.common.lora import LoraError, check_name, read_adapter
from pagedserve.gateway.errors import RequestError
from pagedserve.v1 import generate_pb2

log = logging.getLogger("pagedserve.gateway")
REFRESH_S = 1.0  # the longest a gateway serves an adapter that another gateway has unloaded
SHARED_KEY = "lora_adapters"


class SharedAdapters:
    """The deployment's registry in Redis: the hash `<prefix>lora_adapters`, name -> folder (redis.asyncio)."""

    def __init__(self, client, prefix: str) -> None:
        self.client, self.key = client, prefix + SHARED_KEY

    async def all(self) -> dict[str, str]:
        return await self.client.hgetall(self.key)

    async def get(self, name: str) -> str | None:
        return await self.client.hget(self.key, name)

    async def add(self, name: str, path: str) -> bool:
        """False: the name is taken."""
        return bool(await self.client.hsetnx(self.key, name, path))

    async def put(self, name: str, path: str) -> None:
        await self.client.hset(self.key, name, path)

    async def remove(self, name: str) -> bool:
        """False: there was no such name."""
        return bool(await self.client.hdel(self.key, name))


class LoraAdapters:
    def __init__(self, enabled: bool = False, modules: dict[str, str] | None = None, max_rank: int = 16,
                 shared: SharedAdapters | None = None) -> None:
        self.enabled, self.max_rank = enabled, max_rank
        self.paths: dict[str, str] = {}
        self.modules = dict(modules or {})
        for name, path in self.modules.items():
            self._check(name, path, name in self.paths)
            self.paths[name] = path
        self.shared = shared if enabled else None
        self._read_at = float("-inf")

    @staticmethod
    def _check_folder(name: str, path: str, max_rank: int) -> None:
        if not isinstance(path, str) or not path:
            raise LoraError("lora_path must name a PEFT folder")
        read_adapter(name, path, max_rank)

    def _check(self, name: str, path: str, taken: bool) -> None:
        """LoraError (its status: 400 or 404) when the adapter cannot be served or its name is `taken`."""
        if not self.enabled:
            raise LoraError("LoRA adapters are off: start the server with --enable-lora")
        check_name(name)
        if taken:
            raise LoraError(f"The lora adapter '{name}' has already been loaded.")
        self._check_folder(name, path, self.max_rank)

    async def publish(self) -> None:
        """A starting gateway's --lora-modules into the shared registry (as they are named there), then its view."""
        if self.shared is None:
            return
        try:
            for name, path in self.modules.items():
                await self.shared.put(name, path)
        except Exception as exc:  # noqa: BLE001 - Redis away: this gateway serves its own modules meanwhile
            log.warning("cannot write --lora-modules to the adapter registry: %s", exc)
        await self.sync(force=True)

    async def sync(self, wanted: str | None = None, force: bool = False) -> None:
        """The shared registry into `paths`: all of it when the view is older than REFRESH_S (or force),
        and `wanted` at once when this view does not know it. Redis away: the last view stays."""
        if self.shared is None:
            return
        try:
            if force or time.monotonic() - self._read_at >= REFRESH_S:
                self.paths = await self.shared.all()
                self._read_at = time.monotonic()
            elif wanted and wanted not in self.paths and (path := await self.shared.get(wanted)):
                self.paths[wanted] = path
        except Exception as exc:  # noqa: BLE001
            log.info("cannot read the adapter registry: %s", exc)

    async def load(self, name: str, path: str) -> None:
        """Register an adapter (every gateway's, with Redis: the hash says whether the name is taken, not this
        gateway's view of it); LoraError when it cannot be served."""
        self._check(name, path, self.shared is None and name in self.paths)
        if self.shared is not None:
            try:
                added = await self.shared.add(name, path)
            except Exception as exc:  # noqa: BLE001
                raise LoraError(f"the adapter registry (Redis) did not answer: {exc}", 503) from None
            if not added:
                raise LoraError(f"The lora adapter '{name}' has already been loaded.")
        self.paths[name] = path

    async def unload(self, name: str) -> None:
        if self.shared is not None:
            try:
                known = await self.shared.remove(name)
            except Exception as exc:  # noqa: BLE001
                raise LoraError(f"the adapter registry (Redis) did not answer: {exc}", 503) from None
            self.paths.pop(name, None)
        else:
            known = self.paths.pop(name, None) is not None
        if not known:
            raise LoraError(f"The lora adapter '{name}' cannot be found.", 404)

    def path_of(self, model: str | None) -> str | None:
        return self.paths.get(model) if model else None

    def stamp(self, gen: generate_pb2.GenerateRequest) -> None:
        """gen's adapter from its model name (none: the base model), in place."""
        path = self.path_of(gen.model)
        gen.params.lora_name, gen.params.lora_path = (gen.model, path) if path else ("", "")
        if path:
            gen.model = ""  # the served model, under the adapter

    def model_cards(self, base: str, max_model_len: int, ready: bool) -> list[dict]:
        """/v1/models' entries of the adapters (vLLM's: root the folder, parent the base model)."""
        return [{"id": name, "object": "model", "created": 0, "owned_by": "pagedserve", "root": path,
                 "parent": base, "max_model_len": max_model_len, "ready": ready}
                for name, path in self.paths.items()]


def as_request_error(exc: LoraError, param: str = "lora_path") -> RequestError:
    if exc.status == 503:
        return RequestError(503, str(exc), None, "service_unavailable", "adapter_registry_unavailable")
    return RequestError(exc.status, str(exc), param, "invalid_request_error" if exc.status == 400 else "NotFoundError",
                        "lora_adapter_not_found" if exc.status == 404 else "invalid_lora_adapter")


async def load_from_body(adapters: LoraAdapters, body: dict) -> str:
    """POST /v1/load_lora_adapter {"lora_name", "lora_path"}: vLLM's answer text, or RequestError."""
    name, path = body.get("lora_name"), body.get("lora_path")
    if not name or not path:
        raise RequestError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    try:
        await adapters.load(name, path)
    except LoraError as exc:
        raise as_request_error(exc) from None
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload_from_body(adapters: LoraAdapters, body: dict) -> str:
    """POST /v1/unload_lora_adapter {"lora_name"}."""
    name = body.get("lora_name")
    if not name:
        raise RequestError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
    try:
        await adapters.unload(name)
    except LoraError as exc:
        raise as_request_error(exc, "lora_name") from None
    return f"Success: LoRA adapter '{name}' removed successfully."

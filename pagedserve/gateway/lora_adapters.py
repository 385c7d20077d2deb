"""The LoRA adapters this gateway serves (--enable-lora, --lora-modules; POST /v1/load_lora_adapter
and /v1/unload_lora_adapter, and their gRPC twins): a name -> PEFT folder registry.

A request names an adapter as its "model": `stamp` sets the request's lora_name and lora_path
(the worker reads the folder on first use, keyed by both) and forwards it under the served model;
a client's own lora_name / lora_path (gRPC) are never taken. A folder is checked when it is
registered (common/lora.read_adapter: files, target modules, ranks against --max-lora-rank), so a
bad one is refused there (404: no such folder; 400: not servable) and never reaches the engine.
Unloading refuses new requests of the adapter; running ones finish with it.

Adapters are the operator's: loading and unloading take the operator key (Caller.admin).
Event loop only.
"""

from __future__ import annotations

from pagedserve.common.lora import LoraError, check_name, read_adapter
from pagedserve.gateway.errors import RequestError
from pagedserve.v1 import generate_pb2


class LoraAdapters:
    def __init__(self, enabled: bool = False, modules: dict[str, str] | None = None, max_rank: int = 16) -> None:
        self.enabled, self.max_rank = enabled, max_rank
        self.paths: dict[str, str] = {}
        for name, path in (modules or {}).items():
            self.load(name, path)

    def load(self, name: str, path: str) -> None:
        """Register an adapter; LoraError (its status: 400 or 404) when it cannot be served."""
        if not self.enabled:
            raise LoraError("LoRA adapters are off: start the server with --enable-lora")
        check_name(name)
        if name in self.paths:
            raise LoraError(f"The lora adapter '{name}' has already been loaded.")
        if not isinstance(path, str) or not path:
            raise LoraError("lora_path must name a PEFT folder")
        read_adapter(name, path, self.max_rank)
        self.paths[name] = path

    def unload(self, name: str) -> None:
        if self.paths.pop(name, None) is None:
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
    return RequestError(exc.status, str(exc), param, "invalid_request_error" if exc.status == 400 else "NotFoundError",
                        "lora_adapter_not_found" if exc.status == 404 else "invalid_lora_adapter")


def load_from_body(adapters: LoraAdapters, body: dict) -> str:
    """POST /v1/load_lora_adapter {"lora_name", "lora_path"}: vLLM's answer text, or RequestError."""
    name, path = body.get("lora_name"), body.get("lora_path")
    if not name or not path:
        raise RequestError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    try:
        adapters.load(name, path)
    except LoraError as exc:
        raise as_request_error(exc) from None
    return f"Success: LoRA adapter '{name}' added successfully."


def unload_from_body(adapters: LoraAdapters, body: dict) -> str:
    """POST /v1/unload_lora_adapter {"lora_name"}."""
    name = body.get("lora_name")
    if not name:
        raise RequestError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
    try:
        adapters.unload(name)
    except LoraError as exc:
        raise as_request_error(exc, "lora_name") from None
    return f"Success: LoRA adapter '{name}' removed successfully."

"""One generation's life in the gateway, written once for the REST front end
(completion_call.CompletionCall) and the gRPC one (grpc_api.GenerationService.Generate):

1. forward_as: the request goes downstream under the caller's internal id (the owner's prefix
   in it), with the owner's prefix-cache salt, and with the gateway's own time stamps only;
2. admit_first: on its first message (the prompt is counted then) its tokens are reserved
   against --max-tokens-in-flight; refused, the downstream call is cancelled and the request
   aborted before the refusal goes up;
3. the caller releases the reservation exactly once when the answer ends (CompletionCall.end,
   Generate's finally).

Runs on the gateway's event loop; no state of its own.
"""

from __future__ import annotations

from pagedserve.gateway.admission import Refusal
from pagedserve.gateway.backend import Backend
from pagedserve.gateway.lora_adapters import LoraAdapters
from pagedserve.gateway.owners import Caller, cache_salt
from pagedserve.v1 import generate_pb2


def forward_as(gen: generate_pb2.GenerateRequest, caller: Caller, client_id: str, received: float,
               prefix_cache_scope: str, adapters: LoraAdapters | None = None) -> str:
    """Stamp gen for downstream (in place); returns its internal request id. adapters: a model
    name that is a LoRA adapter's runs the served model with it (lora_adapters.stamp)."""
    gen.request_id = caller.internal_id(client_id)
    (adapters or LoraAdapters()).stamp(gen)
    gen.params.cache_salt = cache_salt(caller.owner, gen.params.cache_salt, prefix_cache_scope)
    gen.ClearField("timings")  # stamps are ours: a client's would corrupt the metrics
    gen.timings.gateway_received = received
    return gen.request_id


def output_budget(gen: generate_pb2.GenerateRequest) -> int | None:
    """max_tokens as sent (None: up to the context)."""
    return gen.params.max_tokens if gen.params.HasField("max_tokens") else None


async def admit_first(backend: Backend, call, request_id: str, first: generate_pb2.GenerateResponse, n: int,
                      max_tokens: int | None, max_model_len: int) -> int:
    """Reserve the request's tokens in flight on its first message; returns the count to release.
    A Refusal cancels the call and aborts the request downstream, then propagates."""
    try:
        return backend.admission.reserve(first.usage.prompt_tokens, n, max_tokens, max_model_len)
    except Refusal:
        call.cancel()
        await backend.abort(request_id)
        raise

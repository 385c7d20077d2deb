"""POST /tokenize and POST /detokenize in vLLM's shapes (serving_tokenization.py), and the chat
half of /tokenize through the same mapping as /v1/chat/completions (protocol.chat_to_generate),
so a chat tokenizes exactly as it would be prompted. The tokenizer service does the work
(tokenizer/tokenization.py); this module validates and translates only.

    /tokenize    {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
                 or {"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
                     "add_special_tokens": false, "chat_template_kwargs": {...}, "return_token_strs": false}
                 -> {"count": N, "max_model_len": M, "tokens": [...], "token_strs": [...] | null}
    /detokenize  {"tokens": [...]} -> {"prompt": str}

Bounds, before the tokenizer sees anything: a /tokenize prompt or chat longer than the context's
character bound (common/request_checks.prompt_chars_problem: max_model_len x 64 characters, as every prompt) and a
/detokenize of more than max_model_len ids are 400 (the tokenizer's thread, which tokenizes every
request, is not to be held by one client).

Threads: the serving event loop.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, ValidationError

from pagedserve.common.request_checks import prompt_chars_problem
from pagedserve.gateway import images
from pagedserve.gateway.backend import RPC_TIMEOUT_S, Backend, rpc_error
from pagedserve.gateway.protocol import ChatCompletionRequest, Message, RequestError, bad_request, chat_to_generate
from pagedserve.v1 import generate_pb2

UINT32_MAX = 2**32 - 1


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[Message]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise bad_request(f"{where}: {first.get('msg')}" if where else str(first.get("msg")),
                          str(first["loc"][0]) if first.get("loc") else None) from None


def tokenize_request(body: Any) -> tuple[str | None, generate_pb2.TokenizeRequest]:
    """(model, TokenizeRequest) of a /tokenize body; RequestError (400) for a bad one."""
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        raise bad_request("a /tokenize body needs exactly one of 'prompt' (text) or 'messages' (a chat)")
    if "prompt" in body:
        req = _parse(TokenizeCompletionRequest, body)
        return req.model, generate_pb2.TokenizeRequest(prompt=req.prompt, add_special_tokens=req.add_special_tokens,
                                                       return_token_strs=bool(req.return_token_strs))
    req = _parse(TokenizeChatRequest, body)
    chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                                 chat_template_kwargs=req.chat_template_kwargs, tools=req.tools)
    gen = chat_to_generate(chat)
    return req.model, generate_pb2.TokenizeRequest(chat=gen.chat, add_special_tokens=req.add_special_tokens,
                                                   return_token_strs=bool(req.return_token_strs))


def detokenize_request(body: Any, max_ids: int | None = None) -> tuple[str | None, generate_pb2.DetokenizeRequest]:
    """(model, DetokenizeRequest) of a /detokenize body; 400 for a bad one, or for more than
    max_ids ids (the context: no sequence of the model is longer)."""
    req = _parse(DetokenizeRequest, body)
    if max_ids is not None and len(req.tokens) > max_ids:
        raise bad_request(f"tokens has {len(req.tokens)} ids: more than the model's context of {max_ids} tokens",
                          "tokens")
    for i, token in enumerate(req.tokens):
        if not 0 <= token <= UINT32_MAX:
            raise bad_request(f"tokens[{i}] = {token} is not a token id (a non-negative 32-bit integer)", "tokens")
    # vLLM decodes with the special tokens: a tokenized chat reads back as its template wrote it.
    return req.model, generate_pb2.DetokenizeRequest(token_ids=req.tokens, skip_special_tokens=False)


async def tokenize(backend: Backend, body: Any) -> dict:
    model, request = tokenize_request(body)
    info = await backend.served_model(model)
    too_long = prompt_chars_problem(request, info.max_model_len)
    if too_long:
        raise RequestError(400, too_long, "messages" if request.WhichOneof("input") == "chat" else "prompt",
                           code="context_length_exceeded")
    await images.resolve(request.chat, info, backend.media, backend.media_client())  # counted expanded
    try:
        reply = await backend.tokenizer.Tokenize(request, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as exc:
        raise _error(exc, "messages" if request.WhichOneof("input") == "chat" else "prompt") from exc
    tokens = list(reply.token_ids)
    return {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens,
            "token_strs": list(reply.token_strs) if request.return_token_strs else None}


def max_detokenize_bytes(max_model_len: int) -> int:
    """The largest /detokenize body that can hold max_model_len ids: 16 bytes an id (ten digits, a
    comma, spacing) and 4 KiB for the rest. A larger body is refused before it is parsed."""
    return 16 * max_model_len + 4096


async def detokenize(backend: Backend, raw: bytes) -> dict:
    info = await backend.served_model(None)  # the bound is its context
    bound = max_detokenize_bytes(info.max_model_len)
    if len(raw) > bound:
        raise bad_request(f"the body has {len(raw)} bytes: more than {info.max_model_len} token ids (the model's "
                          f"context) can take ({bound} bytes); tokens has too many ids", "tokens")
    try:
        body = json.loads(raw)
    except ValueError:
        raise RequestError(400, "the body is not valid JSON") from None
    model, request = detokenize_request(body, info.max_model_len)
    await backend.served_model(model)
    try:
        reply = await backend.tokenizer.Detokenize(request, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as exc:
        raise _error(exc, "tokens") from exc
    return {"prompt": reply.text}


def _error(exc: grpc.RpcError, param: str) -> RequestError:
    error = rpc_error(exc)
    if error.status == 400:
        error.param = param
    return error

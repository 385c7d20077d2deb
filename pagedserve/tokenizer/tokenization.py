"""/tokenize and /detokenize as the tokenizer service answers them (vLLM's serving_tokenization):
plain functions over the HF tokenizer, run on the service's tokenize thread.

A prompt is encoded with the tokenizer's special tokens unless add_special_tokens is false; a
chat is rendered by the chat template (which writes its own special tokens) and encoded without
them unless add_special_tokens is true: vLLM's defaults for each shape. Token ids to detokenize
are checked against the vocabulary first, so a bad id is INVALID_ARGUMENT naming it, not a
tokenizer exception.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from pagedserve.common.grpc_util import StatusError
from pagedserve.v1 import generate_pb2

def tokenize(tokenizer, request: generate_pb2.TokenizeRequest,
             render_chat: Callable[[generate_pb2.ChatMessages], str]) -> generate_pb2.TokenizeResponse:
    """A prompt or a chat (render_chat: its prompt text) to token ids, and the token strings when
    asked. Raises StatusError for a bad chat."""
    which = request.WhichOneof("input")
    if which == "chat":
        text = render_chat(request.chat)
        special = request.add_special_tokens if request.HasField("add_special_tokens") else False
    else:
        text = request.prompt
        special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    ids = list(tokenizer.encode(text, add_special_tokens=special)) if text else []
    response = generate_pb2.TokenizeResponse(token_ids=ids, text=text)
    if request.return_token_strs:
        response.token_strs.extend(tokenizer.convert_ids_to_tokens(ids))
    return response


def detokenize(tokenizer, request: generate_pb2.DetokenizeRequest, vocab_limit: int) -> generate_pb2.DetokenizeResponse:
    ids = list(request.token_ids)
    for i, tid in enumerate(ids):
        if tid >= vocab_limit:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"tokens[{i}] = {tid} is out of range: the vocabulary has {vocab_limit} tokens")
    return generate_pb2.DetokenizeResponse(text=tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens))

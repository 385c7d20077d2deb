"""ChatMessages (proto) -> what HF chat templates take: the `messages` list, the `tools` list and
the chat_template_kwargs.

Templates written for tool calling (Qwen2.5, Hermes, Llama 3.1, Mistral) read
  - tools as OpenAI entries: {"type": "function", "function": {"name", "description", "parameters"}};
  - an assistant message's tool_calls as [{"id", "type": "function", "function": {"name", "arguments"}}]
    with `arguments` a dict (they render it with `| tojson`; a JSON string would be quoted twice),
    so arguments that are a JSON object are decoded here, as vLLM does; anything else stays text;
  - a tool message as {"role": "tool", "content", "tool_call_id"} (and "name" when the client sent one).
Fields the client did not send are left out, so a template's `is defined` tests see what they would
see under transformers.

A message with images (ChatMessage.parts) is rendered with HF's multimodal content list,
[{"type": "image"}, {"type": "text", "text": ...}] in the client's order, as llava-hf's templates
expect; its images are returned beside the messages, in prompt order. With list_content (a
template that iterates over message['content'], vLLM's "openai" content format) a text message's
content is [{"type": "text", "text": ...}] too (chat_templates.takes_content_lists).
Pure functions, no state: called on the tokenizer thread.
"""

from __future__ import annotations

import json

import grpc

from pagedserve.common.grpc_util import StatusError
from pagedserve.v1 import generate_pb2

MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024
MAX_DOCUMENTS_BYTES = 1 << 20  # a RAG request's documents (the gateway's body limit is as much)


def template_kwargs(chat: generate_pb2.ChatMessages) -> dict | None:
    """The chat's chat_template_kwargs (a JSON object on the wire), with its documents (a JSON list,
    vLLM's `documents` variable), or None."""
    documents = _documents(chat.documents) if chat.documents else None
    if not chat.chat_template_kwargs:
        return None if documents is None else {"documents": documents}
    if len(chat.chat_template_kwargs) > MAX_TEMPLATE_KWARGS_BYTES:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"chat_template_kwargs has {len(chat.chat_template_kwargs)} bytes (at most "
                          f"{MAX_TEMPLATE_KWARGS_BYTES})")
    try:
        value = json.loads(chat.chat_template_kwargs)
    except ValueError as exc:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"chat_template_kwargs is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "chat_template_kwargs must be a JSON object")
    if documents is not None:
        if "documents" in value:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              "documents is set twice: as a field and in chat_template_kwargs")
        value["documents"] = documents
    return value


def _documents(text: str) -> list:
    if len(text) > MAX_DOCUMENTS_BYTES:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"documents has {len(text)} bytes (at most {MAX_DOCUMENTS_BYTES})")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"documents is not JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(d, dict) for d in value):
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "documents must be a JSON list of objects")
    return value


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _content(m: generate_pb2.ChatMessage, images: list[bytes], list_content: bool):
    if not m.parts:  # as vLLM's "openai" content format: a string is one text part, none (a call's) none
        if not list_content:
            return m.content
        return [{"type": "text", "text": m.content}] if m.content or not m.tool_calls else []
    content = []
    for j, part in enumerate(m.parts):
        kind = part.WhichOneof("part")
        if kind == "text":
            content.append({"type": "text", "text": part.text})
        elif kind == "image":
            content.append({"type": "image"})
            images.append(part.image)
        else:  # image_url: the gateway's to fetch; none reaches here from it
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"parts[{j}]: a {kind or 'empty'} part is not taken "
                              "here (an image is sent as its bytes)")
    return content


def template_messages(chat: generate_pb2.ChatMessages, list_content: bool = False) -> tuple[list[dict], list[bytes]]:
    """(the template's messages, the chat's images in order)."""
    messages, images = [], []
    for m in chat.messages:
        message: dict = {"role": m.role, "content": _content(m, images, list_content)}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                                     for c in m.tool_calls]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        messages.append(message)
    return messages, images


def template_tools(chat: generate_pb2.ChatMessages) -> list[dict] | None:
    """None when the request offers no tools (templates test `if tools`; None renders as before)."""
    if not chat.tools:
        return None
    tools = []
    for i, t in enumerate(chat.tools):
        function: dict = {"name": t.name}
        if t.description:
            function["description"] = t.description
        # An empty schema is what OpenAI assumes when none is sent.
        try:
            function["parameters"] = json.loads(t.parameters_json) if t.parameters_json else \
                {"type": "object", "properties": {}}
        except ValueError as exc:
            raise ValueError(f"tools[{i}].parameters_json is not JSON: {exc}") from None
        tools.append({"type": "function", "function": function})
    return tools

"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, over the chat path.

A Messages body is mapped onto a ChatCompletionRequest (system -> a system message; text, tool_use, tool_result and
image blocks -> content (images: OpenAI's image_url parts, base64 as a data: URL), assistant tool_calls and tool
messages; tools and tool_choice -> OpenAI's; stop_sequences -> stop; vLLM's EXTENSIONS as they are), which runs as
any chat request does, as one CompletionCall in `raw` mode (completion_call.py: admission, tools, structured
outputs, the reasoning parser, metrics, abort on disconnect). Its answer is mapped back: a message with text,
tool_use (and, with --reasoning-parser, thinking) blocks, stop_reason end_turn / max_tokens / stop_sequence /
tool_use, usage in input/output tokens; streamed, Anthropic's event sequence (message_start, content_block_start /
_delta / _stop per block, message_delta, message_stop).

Which stop sequence ended a message: the request asks for the stop string in the output and this
module strips it (streamed, text that may begin a stop sequence is held until the next piece or
the end). Errors are Anthropic's {"type": "error", "error": {"type", "message"}}, before the headers
as the HTTP status, after them as an `error` event. The API key may come as `x-api-key`
(http_gate.py). Threads: the gateway's event loop. No state beyond one request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagedserve.gateway.backend import RPC_TIMEOUT_S, Backend, as_request_error
from pagedserve.gateway.completion_call import CompletionCall
from pagedserve.common.request_checks import prompt_chars_problem
from pagedserve.gateway.protocol import ChatCompletionRequest, RequestError, bad_request, chat_to_generate
from pagedserve.gateway.sse import DONE, SSE_HEADERS, CancellingStream
from pagedserve.gateway import images, tools
from pagedserve.v1 import generate_pb2

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
# vLLM's sampling extensions a Messages body may carry too (opt-in: Anthropic's clients send none).
EXTENSIONS = ("seed", "structured_outputs", "min_tokens", "repetition_penalty", "priority")
# Anthropic's fields this API takes; any other is refused (400 naming it), never dropped. metadata
# (user_id) has no effect on the answer; cache_control on blocks is accepted (the prefix cache is
# automatic); thinking {"type": "enabled" | "disabled"} is the template's enable_thinking.
FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p",
          "top_k", "tools", "tool_choice", "metadata", "thinking"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(exc: RequestError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message), status_code=exc.status, headers=exc.headers)


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


# ---- the request --------------------------------------------------------------------------------
def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", "messages")
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}[{j}]: only text blocks are supported here, got {block!r:.80}", "messages")
        texts.append(block["text"])
    return "\n".join(texts)


def _message(i: int, message: Any) -> list[dict]:
    """One Anthropic message -> OpenAI chat messages (a user turn's tool results come first, as
    tool messages)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise bad_request(f'{where} must be {{"role": "user" | "assistant", "content": ...}}', "messages")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", "messages")
    texts, calls, results, parts = [], [], [], []  # parts: the text and image blocks, in order
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise bad_request(f'{at} must be {{"type": "tool_use", "id", "name", "input": {{...}}}}', "messages")
            calls.append({"id": str(block.get("id") or ""), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{at}.tool_use_id must be the id of the tool_use it answers", "messages")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _text_of(block.get("content", ""), f"{at}.content")})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier turns' thinking is not shown to the model again (as Anthropic's own API)
        else:
            raise bad_request(f"{at}: {kind!r} blocks are not supported in a {role} message (text, tool_use in "
                              "assistant messages, tool_result and image in user messages)", "messages")
    out = list(results)
    if calls:
        out.append({"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls})
    elif len(parts) > len(texts):  # with images: OpenAI's parts (gateway/images.py checks them)
        out.append({"role": role, "content": parts})
    elif texts or not results:
        out.append({"role": role, "content": "\n".join(texts)})
    return out


def _image_url(source: Any, where: str) -> str:  # an image block's source as an image_url part's URL
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind != "url" or not isinstance(source.get("url"), str):
        raise bad_request(f'{where}.source: an image source is {{"type": "base64", ...}} or a url', "messages")
    return source["url"]


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice -> (OpenAI's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = False if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request('tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}',
                      "tool_choice")


def _tools(given: Any) -> list[dict] | None:
    if given is None:
        return None
    if not isinstance(given, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(given):
        if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
            raise bad_request(f"tools[{i}]: {tool['type']!r} tools (Anthropic's server tools) are not supported; "
                              "only client tools with an input_schema", "tools")
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise bad_request(f'tools[{i}] must be {{"name": ..., "input_schema": {{...}}}}', "tools")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def to_chat(body: Any, count_only: bool = False) -> ChatCompletionRequest:
    """A Messages body -> the chat request it runs as; 400 naming the field for a bad one."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    unknown = sorted(set(body) - FIELDS - set(EXTENSIONS))
    if unknown:
        raise bad_request(f"{unknown[0]} is not supported by this server's Messages API", unknown[0])
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise bad_request("messages: a non-empty list of messages is required", "messages")
    max_tokens = body.get("max_tokens")
    if not count_only and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise bad_request(f"max_tokens: a positive integer is required, got {max_tokens!r}", "max_tokens")
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, message in enumerate(body["messages"]):
        messages += _message(i, message)
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)):
        raise bad_request("stop_sequences must be a list of non-empty strings", "stop_sequences")
    tool_choice, parallel = _tool_choice(body.get("tool_choice"))
    fields = {"model": body.get("model"), "messages": messages, "max_tokens": None if count_only else max_tokens,
              "stream": bool(body.get("stream")) and not count_only, "tools": _tools(body.get("tools")),
              "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    for name in ("temperature", "top_p", "top_k", *EXTENSIONS):
        if body.get(name) is not None:
            fields[name] = body[name]
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
            raise bad_request('thinking must be {"type": "enabled", ...} or {"type": "disabled"}', "thinking")
        fields["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
    if stops:  # asked for in the output, so the one that matched can be told (and stripped here)
        fields.update(stop=stops, include_stop_str_in_output=True)
    if fields["stream"]:
        fields["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise bad_request(f"{where}: {first.get('msg')}", where.split(".")[0] or None) from None


# ---- the answer ---------------------------------------------------------------------------------
def strip_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """(text without the stop sequence it ends with, that sequence or None)."""
    for stop in sorted(stops, key=len, reverse=True):
        if stop and text.endswith(stop):
            return text[:-len(stop)], stop
    return text, None


def held_length(text: str, stops: list[str]) -> int:
    """How much of text's end to hold: the longest end that is a start of a stop sequence (or a
    whole one: the output ends with it when it matched)."""
    return max((n for stop in stops for n in range(min(len(stop), len(text)), 0, -1)
                if text.endswith(stop[:n])), default=0)


def _usage(usage: dict | None) -> dict:
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage.get("prompt_tokens", 0) - cached, "output_tokens": usage.get("completion_tokens", 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_body(chat: dict, stops: list[str], message_id: str) -> dict:
    """A non-streamed chat.completion -> Anthropic's message."""
    choice = chat["choices"][0]
    message, reason = choice["message"], choice["finish_reason"]
    content, stop_sequence = [], None
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    text = message.get("content") or ""
    if reason == "stop" and stops:
        text, stop_sequence = strip_stop(text, stops)
    if text:
        content.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _tool_input(call["function"]["arguments"])})
    return {"id": message_id, "type": "message", "role": "assistant", "model": chat["model"], "content": content,
            "stop_reason": "stop_sequence" if stop_sequence else STOP_REASONS.get(reason, "end_turn"),
            "stop_sequence": stop_sequence, "usage": _usage(chat.get("usage"))}


class EventBuilder:
    """A chat stream's chunks -> Anthropic's events. Blocks open as their kind of delta arrives
    (thinking, text, one per tool call) and close when another begins or the message ends."""

    def __init__(self, message_id: str, model: str, input_tokens: int, stops: list[str]) -> None:
        self.message_id, self.model, self.input_tokens, self.stops = message_id, model, input_tokens, stops
        self.index = -1
        self.open: tuple | None = None  # ("thinking" | "text", None) or ("tool_use", call index)
        self.held = ""  # text that may be the start of a stop sequence (or one, at the very end)
        self.reason: str | None = None

    def start(self) -> list[str]:
        return [_event("message_start", {"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}})]

    def _block(self, key: tuple, block: dict) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = key
        out.append(_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block}))
        return out

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        out = [] if self.open == ("text", None) else self._block(("text", None), {"type": "text", "text": ""})
        return out + [self._delta({"type": "text_delta", "text": text})]

    def chunk(self, chunk: dict) -> list[str]:
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open != ("thinking", None):
                    out += self._block(("thinking", None), {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                text = self.held + delta["content"]
                keep = held_length(text, self.stops)
                self.held = text[len(text) - keep:] if keep else ""
                out += self._text(text[:len(text) - keep])
            for call in delta.get("tool_calls") or []:
                if call.get("id"):
                    out += self._text(self.held)
                    self.held = ""
                    out += self._block(("tool_use", call["index"]), {"type": "tool_use", "id": call["id"],
                                                                      "name": call["function"]["name"], "input": {}})
                arguments = (call.get("function") or {}).get("arguments")
                if arguments:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
            if choice.get("finish_reason"):
                self.reason = choice["finish_reason"]
        return out

    def finish(self, usage: dict | None) -> list[str]:
        text, stop_sequence = self.held, None
        if self.reason == "stop" and self.stops:
            text, stop_sequence = strip_stop(text, self.stops)
        out = self._text(text) + self._close()
        reason = "stop_sequence" if stop_sequence else STOP_REASONS.get(self.reason or "stop", "end_turn")
        usage_out = _usage(usage)
        out.append(_event("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                                            "usage": usage_out}))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return out


# ---- the routes ---------------------------------------------------------------------------------
async def run_messages(backend: Backend, request: Request, body: Any) -> Response:
    """POST /v1/messages; any failure before the headers is an Anthropic-shaped HTTP error."""
    try:
        chat = to_chat(body)
        call = CompletionCall(backend, request, True, chat)
        call.raw = True
        answer = await call.start()
    except RequestError as exc:
        return error_response(exc)
    except Exception as exc:
        return error_response(as_request_error(exc))
    message_id = "msg_" + call.client_id.split("-", 1)[-1]
    headers = {"x-request-id": call.client_id}
    stops = list(chat.stop or [])
    if not chat.stream:
        return JSONResponse(message_body(answer, stops, message_id), headers=headers)
    builder = EventBuilder(message_id, call.model, call.prompt_tokens, stops)
    return CancellingStream(_events(builder, answer), call._closed, {**headers, **SSE_HEADERS})


async def _events(builder: EventBuilder, chunks: AsyncIterator) -> AsyncIterator[str]:
    for event in builder.start():
        yield event
    usage = None
    async for item in chunks:
        if item is DONE or isinstance(item, str):
            continue
        if "error" in item:  # in-band: Anthropic's error event ends the stream
            error = item["error"]
            status = 503 if error.get("code") == "server_shutdown" else 500
            yield _event("error", error_body(status, error.get("message", "error")))
            return
        if item.get("usage") and not item.get("choices"):
            usage = item["usage"]
            continue
        for event in builder.chunk(item):
            yield event
    for event in builder.finish(usage):
        yield event


async def count_tokens(backend: Backend, body: Any) -> Response:
    """POST /v1/messages/count_tokens: {"input_tokens": N}, the templated prompt's tokens."""
    try:
        chat = to_chat(body, count_only=True)
        gen = chat_to_generate(chat)
        if chat.tools:
            tools.render_tools(chat.tools, gen)
        info = await backend.served_model(chat.model)
        request = generate_pb2.TokenizeRequest(chat=gen.chat, add_special_tokens=False)
        too_long = prompt_chars_problem(request, info.max_model_len)
        if too_long:
            raise RequestError(400, too_long, "messages", code="context_length_exceeded")
        await images.resolve(request.chat, info, backend.media, backend.media_client())  # (counted expanded)
        reply = await backend.tokenizer.Tokenize(request, timeout=RPC_TIMEOUT_S)
    except RequestError as exc:
        return error_response(exc)
    except Exception as exc:
        return error_response(as_request_error(exc))
    return JSONResponse({"input_tokens": len(reply.token_ids)})

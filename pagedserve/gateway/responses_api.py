"""OpenAI's Responses API: POST /v1/responses, over the chat path (GET and DELETE by id, and the stored
records: response_records.py).

A request's `input` (a string, or message / function_call / function_call_output items),
`instructions`, function `tools`, `tool_choice` and `text.format` are mapped onto a
ChatCompletionRequest, which runs as any chat request does, as one CompletionCall in `raw` mode
(completion_call.py: admission, tools, structured outputs, the reasoning parser, metrics, abort on
disconnect). Its answer becomes a response object (responses_output.py) whose `output` holds a
reasoning item (with --reasoning-parser), a message with output_text, and function_call items;
streamed, the typed events (response.created, response.in_progress, response.output_item.added, content_part.added,
output_text.delta / reasoning_text.delta / function_call_arguments.delta, their .done, and
response.completed or response.incomplete), each with its sequence_number.

Stored responses (`store`, true by default): the response object and the conversation that led to
it (the chat messages, then this output) are kept for --request-retention seconds under the
caller's owner (response_records.py). `previous_response_id` continues that conversation; another
owner's id, an expired one or one never stored answers 404 as if it did not exist. Fields this API
does not take are refused
(400 naming the field). Threads: the gateway's event loop; the store's calls in a worker thread.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagedserve.gateway.backend import Backend, as_request_error
from pagedserve.gateway.completion_call import CompletionCall
from pagedserve.gateway.sse import SSE_HEADERS
from pagedserve.gateway.owners import SINGLE_TENANT
from pagedserve.gateway.protocol import ChatCompletionRequest, RequestError, bad_request
from pagedserve.gateway.response_records import records
from pagedserve.gateway.responses_output import EventBuilder, Shell, output_messages, response_output, response_usage
from pagedserve.gateway.sse import DONE, CancellingStream

log = logging.getLogger("pagedserve.gateway")

# The fields this API takes (others: 400). metadata and user are kept on the object, unused.
FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
          "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id", "metadata",
          "user", "truncation", "reasoning"}
# vLLM's sampling extensions a body may carry too (opt-in).
EXTENSIONS = ("seed", "top_k", "min_tokens", "repetition_penalty", "priority", "structured_outputs")


# ---- the request --------------------------------------------------------------------------------
def _content_text(content: Any, where: str, images: bool = False) -> str | list[dict]:
    """The text of content; with images (a message's content), OpenAI chat parts when it has an
    input_image (its image_url string: gateway/images.py checks it)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", "input")
    texts, parts = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if images and kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
            continue
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]: only input_text / output_text{' / input_image' if images else ''} "
                              f"parts are supported, got type {kind!r}", "input")
        texts.append(part["text"])
        parts.append({"type": "text", "text": part["text"]})
    return parts if len(parts) > len(texts) else "\n".join(texts)


def input_messages(given: Any) -> list[dict]:
    """`input` -> chat messages (consecutive function_call items become one assistant turn)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            out.append({"role": item["role"], "content": _content_text(item.get("content"), f"{where}.content", True)})
        elif kind == "function_call" and isinstance(item.get("name"), str) and isinstance(item.get("call_id"), str):
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": str(item.get("arguments") or "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _content_text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again
        else:
            raise bad_request(f"{where}: {kind!r} items are not supported (message, function_call, "
                              "function_call_output, reasoning)", "input")
    return out


def _tools(given: Any) -> list[dict] | None:
    if given is None:
        return None
    if not isinstance(given, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(given):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{i}]: {kind!r} tools are not supported; only function tools", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "auto" | "required" | "none" (checked by the chat path)


def _text_format(text: Any) -> dict | None:
    """text.format -> response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise bad_request(f"text.format.type must be text, json_schema or json_object, got {kind!r}", "text")


def to_chat(body: Any, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """(the chat request, the conversation's messages without instructions) for a Responses body
    that follows `history` (a previous response's conversation, or [])."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    unknown = sorted(set(body) - FIELDS - set(EXTENSIONS))
    if unknown:
        raise bad_request(f"{unknown[0]} is not supported by this server's Responses API", unknown[0])
    reasoning = body.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict) or any(v is not None for v in reasoning.values())):
        raise bad_request("reasoning (effort, summary) is not supported: the model thinks as its template and "
                          "chat_template_kwargs say, and --reasoning-parser reads it", "reasoning")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request('truncation must be "disabled" (the prompt is never truncated)', "truncation")
    conversation = history + input_messages(body.get("input"))
    messages = list(conversation)
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise bad_request("instructions must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    fields = {"model": body.get("model"), "messages": messages, "stream": bool(body.get("stream")),
              "max_tokens": body.get("max_output_tokens"), "tools": _tools(body.get("tools")),
              "tool_choice": _tool_choice(body.get("tool_choice")),
              "parallel_tool_calls": body.get("parallel_tool_calls"), "response_format": _text_format(body.get("text"))}
    for name in ("temperature", "top_p", *EXTENSIONS):
        if body.get(name) is not None:
            fields[name] = body[name]
    if fields["stream"]:
        fields["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(fields), conversation
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise bad_request(f"{where}: {first.get('msg')}", where.split(".")[0] or None) from None


# ---- stored responses ---------------------------------------------------------------------------
# ---- the routes ---------------------------------------------------------------------------------
async def create(backend: Backend, request: Request, body: Any) -> Response:
    """POST /v1/responses; any failure before the headers is an HTTP error (OpenAI's shape)."""
    owner = getattr(request.state, "caller", SINGLE_TENANT).owner
    try:
        history = []
        if isinstance(body, dict) and body.get("previous_response_id") is not None:
            previous = await records(backend).load(str(body["previous_response_id"]), owner)
            history = previous["conversation"]
        chat, conversation = to_chat(body, history)
        call = CompletionCall(backend, request, True, chat)
        call.raw = True
        answer = await call.start()
    except RequestError:
        raise
    except Exception as exc:
        raise as_request_error(exc) from exc
    shell = Shell(body, "resp_" + call.client_id.split("-", 1)[-1], call.model)
    store = body.get("store", True) is not False
    headers = {"x-request-id": call.client_id}

    async def keep(final: dict) -> None:
        if store:
            await records(backend).save(shell.id, {"owner": owner, "response": final,
                                                   "conversation": conversation + output_messages(final["output"])})

    if not chat.stream:
        output, status = response_output(answer)
        final = shell.object(status, output, response_usage(answer.get("usage")))
        await keep(final)
        return JSONResponse(final, headers=headers)
    return CancellingStream(_events(EventBuilder(shell), answer, keep), call._closed, {**headers, **SSE_HEADERS})


async def _events(builder: EventBuilder, chunks: AsyncIterator, keep) -> AsyncIterator[str]:
    for event in builder.start():
        yield event
    usage = None
    async for item in chunks:
        if item is DONE or isinstance(item, str):
            continue
        if "error" in item:  # in-band: the response failed
            failed = builder.shell.object("failed", builder.output, None)
            failed["error"] = {"code": "server_error", "message": item["error"].get("message", "error")}
            yield builder._emit({"type": "response.failed", "response": failed})
            return
        if item.get("usage") and not item.get("choices"):
            usage = item["usage"]
            continue
        for event in builder.chunk(item):
            yield event
    events, final = builder.finish(usage)
    await keep(final)
    for event in events:
        yield event

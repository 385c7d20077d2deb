"""The Responses API's answer (responses_api.py): a chat completion's first choice as the response
object's `output` items (a reasoning item, a message with output_text, function_call items), the
object's fields that do not depend on the output (Shell), and a chat stream's chunks as the typed
events (EventBuilder: response.created, response.in_progress, response.output_item.added,
content_part.added, output_text.delta / reasoning_text.delta / function_call_arguments.delta, their
.done, and response.completed or response.incomplete), each with its sequence_number; and the
output items as the conversation's next chat messages (for previous_response_id).

Invariants: an item's id is new (rs_, msg_, fc_ and 32 hex digits); a stream's sequence numbers
count up from 0 with no gap, and its final object holds the items its events announced. Plain
Python, no I/O; one EventBuilder per stream. Threads: the gateway's event loop.
"""

from __future__ import annotations

import json
import time
import uuid


def _event(data: dict) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: dict | None) -> dict:
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": _new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _new_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class Shell:
    """The response object's fields that do not depend on the output."""

    def __init__(self, body: dict, response_id: str, model: str) -> None:
        self.id, self.model, self.created = response_id, model, int(time.time())
        self.body = body

    def object(self, status: str, output: list[dict], usage: dict | None, reason: str | None = None) -> dict:
        body = self.body
        text = body.get("text") or {"format": {"type": "text"}}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": incomplete,
                "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "model": self.model, "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "previous_response_id": body.get("previous_response_id"), "reasoning": body.get("reasoning"),
                "store": body.get("store", True), "temperature": body.get("temperature"), "text": text,
                "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                "top_p": body.get("top_p"), "truncation": "disabled", "usage": usage,
                "user": body.get("user"), "metadata": body.get("metadata") or {}}


def response_output(chat: dict) -> tuple[list[dict], str]:
    """A chat.completion's first choice -> (output items, status)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        output.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return output, "incomplete" if choice["finish_reason"] == "length" else "completed"


def output_messages(output: list[dict]) -> list[dict]:
    """The output items as the conversation's next chat messages (reasoning left out)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]


class EventBuilder:
    """A chat stream's chunks -> the Responses API's typed events. An item opens when its kind of
    delta arrives (reasoning, the message's text, each call) and is done when another opens or the
    response ends."""

    def __init__(self, shell: Shell) -> None:
        self.shell, self.sequence = shell, 0
        self.output: list[dict] = []
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}  # a chunk's tool-call index -> its item
        self.reason: str | None = None

    def _emit(self, data: dict) -> str:
        data["sequence_number"] = self.sequence
        self.sequence += 1
        return _event(data)

    def start(self) -> list[str]:
        created = self.shell.object("in_progress", [], None)
        return [self._emit({"type": "response.created", "response": created}),
                self._emit({"type": "response.in_progress", "response": created})]

    def _add(self, item: dict) -> list[str]:
        out = self._done()
        self.open = item
        self.output.append(item)
        at = len(self.output) - 1
        shown = {**item, "status": "in_progress"}
        if item["type"] == "message":
            shown["content"] = []
        if item["type"] == "reasoning":
            shown["content"] = []
        out.append(self._emit({"type": "response.output_item.added", "output_index": at, "item": shown}))
        if item["type"] == "message":
            out.append(self._emit({"type": "response.content_part.added", "item_id": item["id"], "output_index": at,
                                   "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}))
        return out

    def _done(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        at, out = self.output.index(item), []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self._emit({"type": "response.output_text.done", "item_id": item["id"], "output_index": at,
                                   "content_index": 0, "text": part["text"], "logprobs": []}))
            out.append(self._emit({"type": "response.content_part.done", "item_id": item["id"], "output_index": at,
                                   "content_index": 0, "part": part}))
        elif item["type"] == "reasoning":
            out.append(self._emit({"type": "response.reasoning_text.done", "item_id": item["id"],
                                   "output_index": at, "content_index": 0, "text": item["content"][0]["text"]}))
        else:
            out.append(self._emit({"type": "response.function_call_arguments.done", "item_id": item["id"],
                                   "output_index": at, "name": item["name"], "arguments": item["arguments"]}))
        out.append(self._emit({"type": "response.output_item.done", "output_index": at, "item": item}))
        return out

    def chunk(self, chunk: dict) -> list[str]:
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open is None or self.open["type"] != "reasoning":
                    out += self._add(_reasoning_item(""))
                self.open["content"][0]["text"] += delta["reasoning_content"]
                out.append(self._emit({"type": "response.reasoning_text.delta", "item_id": self.open["id"],
                                       "output_index": len(self.output) - 1, "content_index": 0,
                                       "delta": delta["reasoning_content"]}))
            if delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    out += self._add(_message_item(""))
                self.open["content"][0]["text"] += delta["content"]
                out.append(self._emit({"type": "response.output_text.delta", "item_id": self.open["id"],
                                       "output_index": len(self.output) - 1, "content_index": 0,
                                       "delta": delta["content"], "logprobs": []}))
            for call in delta.get("tool_calls") or []:
                if call.get("id"):
                    self.calls[call["index"]] = _call_item(call["id"], call["function"]["name"], "")
                    out += self._add(self.calls[call["index"]])
                item = self.calls.get(call["index"])
                arguments = (call.get("function") or {}).get("arguments")
                if item is not None and arguments:
                    item["arguments"] += arguments
                    out.append(self._emit({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                                           "output_index": self.output.index(item), "delta": arguments}))
            if choice.get("finish_reason"):
                self.reason = choice["finish_reason"]
        return out

    def finish(self, usage: dict | None) -> tuple[list[str], dict]:
        out = self._done()
        status = "incomplete" if self.reason == "length" else "completed"
        final = self.shell.object(status, self.output, response_usage(usage))
        out.append(self._emit({"type": f"response.{status}", "response": final}))
        return out, final


"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls` and the
tool-call history, checked and mapped onto the GenerateRequest, and how the output is read back.

  tool_choice "none"   the tools are neither rendered nor parsed (plain chat);
  "auto" (the default with tools)   rendered by the chat template, the output read by the
                       --tool-call-parser (400 when none is configured, as vLLM does);
  "required"           rendered, and the output constrained by structured outputs to a JSON array
                       of {"name", "parameters"} objects, one of the tools each (vLLM's schema);
  {"type": "function", "function": {"name": N}}   rendered, and the output constrained to N's
                       parameters schema: it is N's arguments.
The forced forms set params.structured_output.json_schema, checked like any structured output
(pagedserve/common/structured_output.py) and applied as a token mask in the worker; they cannot be
combined with response_format or another constraint. Pure functions and a small dataclass; no I/O.
Threads: the gateway's event loop (request mapping, and the response shapes at its end).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pagedserve.common import structured_output
from pagedserve.common.sampling_params import StructuredOutput
from pagedserve.gateway.block_tool_parsers import BLOCK_PARSERS
from pagedserve.gateway.errors import bad_request
from pagedserve.gateway.tool_parsers import PARSERS, NamedCallParser, Parsed, RequiredCallsParser, ToolParser, assemble
from pagedserve.v1 import generate_pb2

# --tool-call-parser's choices: the streaming JSON parsers and the block parsers.
ALL_PARSERS: dict[str, type[ToolParser]] = {**PARSERS, **BLOCK_PARSERS}
# Parsers whose tags are special tokens: the output keeps them (vLLM's adjust_request does the same).
KEEP_SPECIAL_TOKENS = ("mistral",)
# OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _bad(message: str, param: str):
    return bad_request(message, param)


def chat_tools(req, gen: generate_pb2.GenerateRequest, tool_call_parser: str | None) -> ToolOutput | None:
    """apply_tools for a ChatCompletionRequest."""
    return apply_tools(req.tools, req.tool_choice, req.parallel_tool_calls, gen, tool_call_parser)


@dataclass(slots=True)
class ToolOutput:
    """How each sample's text is read: by a parser (auto), as one named call, or as the required
    array. `state()`/`from_state` keep it in a stream's resume record."""

    parser: str | None = None  # a PARSERS name (auto)
    function: str | None = None  # the named function
    required: bool = False
    max_calls: int | None = None
    schemas: dict[str, dict] | None = None  # the tools' parameters (block parsers type values by them)

    def new(self, stream: bool = True) -> ToolParser:
        if self.function is not None:
            return NamedCallParser(self.function, stream=stream)
        if self.required:
            return RequiredCallsParser(stream=stream, max_calls=self.max_calls)
        if self.parser in BLOCK_PARSERS:
            return BLOCK_PARSERS[self.parser](stream=stream, max_calls=self.max_calls, schemas=self.schemas)
        return PARSERS[self.parser](stream=stream, max_calls=self.max_calls)

    def parse(self, text: str) -> Parsed:
        parser = self.new(stream=False)
        return assemble(parser.feed(text) + parser.finish())

    def state(self) -> dict:
        return {"parser": self.parser, "function": self.function, "required": self.required,
                "max_calls": self.max_calls, "schemas": self.schemas}

    @classmethod
    def from_state(cls, state: dict | None) -> ToolOutput | None:
        return cls(**state) if state else None


def _tool(entry: Any, i: int) -> tuple[generate_pb2.Tool, dict]:
    where = f"tools[{i}]"
    if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(entry.get("function"), dict):
        raise _bad(f'{where} must be {{"type": "function", "function": {{"name": ..., ...}}}}', "tools")
    function = entry["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.function.description must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"{where}.function.parameters must be a JSON Schema object, got {type(parameters).__name__}",
                   "tools")
    tool = generate_pb2.Tool(name=name, description=description or "",
                             parameters_json=json.dumps(parameters) if parameters is not None else "")
    if parameters is None:
        return tool, EMPTY_PARAMETERS
    # A forced call's arguments are an object even when the schema leaves the type out ({}).
    return tool, parameters if "type" in parameters else {"type": "object", **parameters}


def _chosen_name(choice: Any) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        return choice["function"]["name"]
    raise _bad('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
               f'{{"name": ...}}}}, got {choice!r}', "tool_choice")


def required_schema(schemas: dict[str, dict], parallel: bool) -> dict:
    """tool_choice "required": a JSON array of calls, each one of the tools (vLLM's shape, but
    closed: a call object has exactly its two keys, so the model cannot ramble on in extra ones)."""
    items = {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
         "required": ["name", "parameters"], "additionalProperties": False} for name, params in schemas.items()]}
    schema: dict = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def apply_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
                gen: generate_pb2.GenerateRequest, tool_call_parser: str | None) -> ToolOutput | None:
    """Check the request's tools and tool_choice, put the tools (and a forced call's schema) on
    gen; the ToolOutput to read the samples with, or None for plain text."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if not tools:
        if tool_choice != "none":
            raise _bad("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    protos, schemas = [], {}
    for i, entry in enumerate(tools):
        tool, schemas_entry = _tool(entry, i)
        if tool.name in schemas:
            raise _bad(f"tools[{i}]: the function name {tool.name!r} is given twice", "tools")
        protos.append(tool)
        schemas[tool.name] = schemas_entry
    if tool_choice == "none":  # the tools are neither offered nor parsed
        return None
    max_calls = 1 if parallel_tool_calls is False else None
    if tool_choice == "auto":
        if tool_call_parser is None:
            raise _bad('tool_choice "auto" (the default with tools) needs the server started with '
                       f"--tool-call-parser ({', '.join(ALL_PARSERS)})", "tool_choice")
        out = ToolOutput(parser=tool_call_parser, max_calls=max_calls,
                         schemas=schemas if tool_call_parser in BLOCK_PARSERS else None)
        schema = None
        if tool_call_parser in KEEP_SPECIAL_TOKENS:
            gen.skip_special_tokens = False
    elif tool_choice == "required":
        out, schema = ToolOutput(required=True, max_calls=max_calls), required_schema(schemas, max_calls is None)
    else:
        name = _chosen_name(tool_choice)
        if name not in schemas:
            raise _bad(f"tool_choice names the function {name!r}, which is not among the tools "
                       f"({', '.join(schemas)})", "tool_choice")
        out, schema = ToolOutput(function=name), schemas[name]
    if schema is not None:
        if gen.params.HasField("structured_output"):
            raise _bad(f"tool_choice {tool_choice!r} constrains the output itself: it cannot be combined with "
                       "response_format or another structured output", "tool_choice")
        spec = StructuredOutput(json_schema=json.dumps(schema))
        try:
            structured_output.check(spec)
        except ValueError as exc:
            raise _bad(f"the tools' parameters do not compile for tool_choice {tool_choice!r}: {exc}", "tools") \
                from None
        gen.params.structured_output.json_schema = spec.json_schema
    gen.chat.tools.extend(protos)
    return out


def render_tools(tools: list[Any], gen: generate_pb2.GenerateRequest) -> None:
    """Check the tools and put them on gen for the chat template only (no parsing, no constraint):
    what a prompt with these tools is, for counting its tokens."""
    names: set[str] = set()
    for i, entry in enumerate(tools):
        tool, _ = _tool(entry, i)
        if tool.name in names:
            raise _bad(f"tools[{i}]: the function name {tool.name!r} is given twice", "tools")
        names.add(tool.name)
        gen.chat.tools.append(tool)


def history_fields(message: Any, proto: generate_pb2.ChatMessage, where: str) -> None:
    """An assistant message's tool_calls and a tool message's tool_call_id onto the proto."""
    for j, call in enumerate(message.tool_calls or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
                not isinstance(function.get("arguments", ""), str):
            raise _bad(f'{where}.tool_calls[{j}] must be {{"id": ..., "type": "function", "function": '
                       '{"name": ..., "arguments": "<JSON text>"}}', "messages")
        proto.tool_calls.add(id=str(call.get("id") or ""), name=function["name"],
                             arguments=function.get("arguments", ""))
    if message.tool_calls and message.role != "assistant":
        raise _bad(f"{where}: only assistant messages carry tool_calls", "messages")
    if message.role == "tool" and not message.tool_call_id:
        raise _bad(f"{where}: a tool message needs the tool_call_id of the call it answers", "messages")
    proto.tool_call_id = message.tool_call_id or ""
    if message.role == "tool" and message.name:  # other roles' names stay out, as before
        proto.name = message.name


# ---- the response shapes ----------------------------------------------------------------------
def message_fields(parsed: Parsed) -> dict:
    """message.content and message.tool_calls of a non-streamed answer (content null beside calls,
    as OpenAI sends it; no tool_calls key without calls, so plain answers keep their bytes)."""
    if not parsed.calls:
        return {"content": parsed.content}
    return {"content": parsed.content or None,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in parsed.calls]}


def stream_deltas(events: list) -> list[dict]:
    """Streamed chunks' deltas for parser events, as OpenAI streams them: content; a call's first
    delta with its index, id, type and whole name (arguments ""); then its argument fragments
    (consecutive fragments of one call go out together)."""
    deltas: list[dict] = []
    for e in events:
        last = deltas[-1] if deltas else None
        if e.content is not None:
            if last is not None and "content" in last:
                last["content"] += e.content
            else:
                deltas.append({"content": e.content})
        elif e.name is not None:
            deltas.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                           "function": {"name": e.name, "arguments": ""}}]})
        elif e.arguments is not None:
            if last is not None and "tool_calls" in last and last["tool_calls"][0]["index"] == e.index \
                    and "id" not in last["tool_calls"][0]:
                last["tool_calls"][0]["function"]["arguments"] += e.arguments
            else:
                deltas.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.arguments}}]})
    return deltas


def finish_reason(reason: str | None, called: bool) -> str | None:
    """"tool_calls" for a sample that stopped by itself after calling; length and abort stay."""
    return "tool_calls" if called and reason == "stop" else reason

"""Tool calling through every service, driven by the official `openai` client, on a tiny random
model whose tokenizer carries a tool-capable (Hermes/Qwen-style) chat template written here.

The model's weights are random, so only a constraint makes it call anything: forced tool_choice
(named, required) is enforced by structured outputs; "auto" is read by --tool-call-parser hermes,
and a structured_outputs regex shaped like a Hermes call stands in for a model trained to write one.
What the model saw is checked on the token ids the scheduler stored for the request, against
transformers' own rendering of the same messages and tools with the same template."""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import openai
import pytest

from pagedserve.gateway.owners import ANONYMOUS
from pagedserve.v1 import scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.slow

TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content or "" }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                             "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    {"role": "user", "content": "And now?"},
]
# A Hermes call, as a model trained for it writes one (with some content before it).
HERMES_REGEX = r'Let me check\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", ' \
               r'"unit": "c"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_model(tiny_model):
    (tiny_model / "chat_template.jinja").write_text(TEMPLATE)
    return tiny_model


@pytest.fixture(scope="module")
def stack(tool_model, launch_stack):
    return launch_stack(tool_model, tool_call_parser="hermes", max_num_seqs=16)


def stored_prompt(stack, request_id: str) -> list[int]:
    """The prompt ids the scheduler holds for the request (the services know it by owner.id)."""
    with grpc.insecure_channel(stack.addresses["scheduler"]) as channel:
        record = scheduler_pb2_grpc.SchedulerStub(channel).GetRequest(
            scheduler_pb2.GetRequestRequest(request_id=f"{ANONYMOUS}.{request_id}"), timeout=30)
    return list(record.prompt_token_ids)


def reference_ids(tool_model, messages, tools) -> list[int]:
    """transformers' rendering, with the assistant's arguments as a dict as HF templates expect."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    hf_messages = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        hf_messages.append(m)
    text = tokenizer.apply_chat_template(hf_messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "get_weather" in text and "21 degrees, sunny" in text and '"city": "Paris"' in text
    return tokenizer.encode(text, add_special_tokens=False)


def check_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def streamed(client, **kw):
    with client.chat.completions.stream(**kw) as stream:
        return stream.get_final_completion()


def test_the_model_sees_the_tools_and_the_tool_result(stack, client, model_name, tool_model):
    out = client.chat.completions.create(model=model_name, messages=HISTORY, tools=TOOLS, max_tokens=4,
                                         temperature=0)
    expected = reference_ids(tool_model, HISTORY, TOOLS)
    assert stored_prompt(stack, out.id) == expected and out.usage.prompt_tokens == len(expected)
    # tool_choice "none": the tools are not offered (the prompt is the plain chat's) nor parsed.
    plain = client.chat.completions.create(model=model_name, messages=HISTORY, tools=TOOLS, tool_choice="none",
                                           max_tokens=4, temperature=0)
    assert stored_prompt(stack, plain.id) == reference_ids(tool_model, HISTORY, None)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_yields_a_valid_call(client, model_name, stream):
    kw = dict(model=model_name, messages=HISTORY, tools=TOOLS, max_tokens=200, temperature=1.0, seed=7,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    out = streamed(client, **kw) if stream else client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    check_call(call, "get_weather")


def test_streamed_calls_assemble_to_the_non_streamed_ones(client, model_name):
    kw = dict(model=model_name, messages=HISTORY, tools=TOOLS, max_tokens=200, temperature=1.0, seed=11,
              tool_choice="required")
    whole = client.chat.completions.create(**kw).choices[0]
    parts = streamed(client, **kw).choices[0]
    assert whole.finish_reason == parts.finish_reason == "tool_calls"
    assert len(whole.message.tool_calls) >= 1
    for call in whole.message.tool_calls:
        check_call(call)
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in parts.message.tool_calls]
    single = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert len(single.message.tool_calls) == 1


def test_auto_reads_hermes_calls_whole_and_streamed(client, model_name):
    kw = dict(model=model_name, messages=HISTORY, tools=TOOLS, max_tokens=120, temperature=1.0, seed=3,
              extra_body={"structured_outputs": {"regex": HERMES_REGEX}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    [call] = whole.message.tool_calls
    check_call(call, "get_weather")
    parts = streamed(client, **kw).choices[0]
    assert parts.message.content == "Let me check." and parts.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in parts.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]
    # Raw chunks: the call's name comes whole in its first delta, then argument fragments.
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert all(d.function.name is None and d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_bad_tool_requests_are_refused(client, model_name):
    def error(messages=HISTORY, **kw) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model_name, messages=messages, max_tokens=2, **kw)
        return info.value

    exc = error(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "launch_rockets"}})
    assert "launch_rockets" in exc.message and exc.body["param"] == "tool_choice"
    exc = error(tools=[{"type": "function", "function": {"name": "bad name!"}}])
    assert "tools[0].function.name" in exc.message and exc.body["param"] == "tools"
    exc = error(tools=[{"type": "retrieval"}])
    assert "tools[0]" in exc.message
    exc = error(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}], tool_choice="none")
    assert "parameters" in exc.message
    exc = error(tool_choice="required")
    assert "tool_choice" in exc.message
    exc = error(messages=[{"role": "tool", "content": "x"}])
    assert "tool_call_id" in exc.message



def sse_events(lines) -> list[tuple[str | None, dict]]:
    events, event_id = [], None
    for line in lines:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            events.append((event_id, json.loads(line[6:])))
    return events


def assembled(chunks: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call, put together from raw chunks by index."""
    content, calls = "", {}
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call.get("function", {}).get("name") or ""
                entry[1] += call.get("function", {}).get("arguments") or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


def test_a_resumed_stream_continues_the_call(stack, model_name):
    """Resumed from an event inside the call, the rest adds up to the same content and call, and
    (vLLM's return_token_ids) to the same token ids, without the prompt's again."""
    body = {"model": model_name, "messages": HISTORY, "tools": TOOLS, "max_tokens": 120, "temperature": 1.0,
            "seed": 3, "stream": True, "stream_options": {"include_event_ids": True},
            "structured_outputs": {"regex": HERMES_REGEX}, "return_token_ids": True}
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", stack.http_url + "/v1/chat/completions", json=body) as reply:
            request_id = reply.headers["x-request-id"]
            events = sse_events(reply.iter_lines())
        whole = assembled([d for _, d in events])
        assert whole[0] == "Let me check." and [name for name, _ in whole[1]] == ["get_weather"]
        inside = [i for i, (_, d) in enumerate(events) if d.get("choices") and
                  (d["choices"][0]["delta"].get("tool_calls") or [{}])[0].get("function", {}).get("arguments")]
        cut = inside[len(inside) // 2]  # the client has the name and part of the arguments
        reply = http.get(f"{stack.http_url}/v1/requests/{request_id}/stream",
                         headers={"Last-Event-ID": events[cut][0]})
        assert reply.status_code == 200, reply.text
    rest = [d for _, d in sse_events(reply.text.splitlines())]
    assert assembled([d for _, d in events[:cut + 1]] + rest) == whole
    assert [c["choices"][0]["finish_reason"] for c in rest if c.get("choices")][-1] == "tool_calls"

    def ids(chunks):
        return [t for c in chunks if c.get("choices") for t in c["choices"][0].get("token_ids") or []]
    assert "prompt_token_ids" in events[0][1] and not any("prompt_token_ids" in c for c in rest)
    assert ids([d for _, d in events[:cut + 1]] + rest) == ids([d for _, d in events])
    assert len(ids(rest)) > 0


def test_public_grpc_api_renders_tools(stack, tool_model):
    """The gRPC Generate API carries the tools and the history in ChatMessages (no parsing there:
    the text comes back as the model wrote it); a tool whose schema is not JSON is INVALID_ARGUMENT."""
    from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

    chat = generate_pb2.ChatMessages(add_generation_prompt=True)
    for m in HISTORY:
        proto = chat.messages.add(role=m["role"], content=m["content"] or "", tool_call_id=m.get("tool_call_id", ""))
        for c in m.get("tool_calls", []):
            proto.tool_calls.add(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
    for t in TOOLS:
        f = t["function"]
        chat.tools.add(name=f["name"], description=f.get("description", ""),
                       parameters_json=json.dumps(f["parameters"]))
    params = common_pb2.SamplingParams(max_tokens=2, temperature=0.0)
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        replies = list(stub.Generate(generate_pb2.GenerateRequest(chat=chat, params=params), timeout=120))
        assert replies[-1].usage.prompt_tokens == len(reference_ids(tool_model, HISTORY, TOOLS))
        chat.tools[0].parameters_json = "{not json"
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generate_pb2.GenerateRequest(chat=chat, params=params), timeout=120))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools[0].parameters_json" in info.value.details()

"""The block tool-call parsers (pagedserve/gateway/block_tool_parsers.py: mistral, deepseek_v3, granite;
typed_tool_parsers.py: qwen3_coder, pythonic), in the formats their models write: whole text, and
every split of it streamed (test_tool_parsers.check_stream_matches), which must give the same
content and calls; malformed blocks are content; parallel_tool_calls=false keeps the first call;
every parser streams a call's arguments in fragments before its block ends."""

from __future__ import annotations

import json

import pytest

from pagedserve.gateway.block_tool_parsers import DeepSeekV3Parser, GraniteParser, MistralParser
from pagedserve.gateway.tool_parsers import assemble
from pagedserve.gateway.tools import ToolOutput, stream_deltas
from pagedserve.gateway.typed_tool_parsers import PythonicParser, Qwen3CoderParser
from test_tool_parsers import calls_of, check_stream_matches

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "metric": {"type": "boolean"}, "tags": {"type": "array"}}}
A = '{"city": "Paris", "days": 2}'
DS_OPEN = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"

CASES = [
    # (parser, text, content, [(name, arguments JSON)])
    (MistralParser, f'Sure. [TOOL_CALLS][{{"name": "get_weather", "arguments": {A}}}]', "Sure.",
     [("get_weather", A)]),
    (MistralParser, f'[TOOL_CALLS]get_weather[ARGS]{A}[TOOL_CALLS]get_time[ARGS]{{}}', "",
     [("get_weather", A), ("get_time", "{}")]),
    (MistralParser, "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    (MistralParser, '[TOOL_CALLS] [{"name": "f", "arguments": {"a": [1, 2]}}, {"name": "g", "parameters": {}} ]', "",
     [("f", '{"a": [1, 2]}'), ("g", "{}")]),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": "{\\"a\\": 1}"}]', "", [("f", '{"a": 1}')]),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": 3}]', '[TOOL_CALLS][{"name": "f", "arguments": 3}]',
     []),
    (MistralParser, "No calls [TOOL here.", "No calls [TOOL here.", []),
    (DeepSeekV3Parser, "Let me look.<｜tool▁calls▁begin｜>" + DS_CALL.format(name="get_weather", args=A)
     + DS_CALL.format(name="get_time", args='{"zone": 1}') + "<｜tool▁calls▁end｜>", "Let me look.",
     [("get_weather", A), ("get_time", '{"zone": 1}')]),
    (DeepSeekV3Parser, "<｜tool▁calls▁begin｜>junk<｜tool▁calls▁end｜> ok",
     "<｜tool▁calls▁begin｜>junk<｜tool▁calls▁end｜> ok", []),
    (DeepSeekV3Parser, "<｜tool▁calls▁begin｜>" + DS_CALL.format(name="f", args="{}"), "",
     [("f", "{}")]),  # cut off before the block's end, its call whole: the call
    (DeepSeekV3Parser, DS_OPEN, DS_OPEN, []),  # cut off before a name: text
    (Qwen3CoderParser, "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\n42\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=tags>\n[\"a\"]\n"
     "</parameter>\n</function>\n</tool_call>", "Checking.",
     [("get_weather", A), ("get_weather", '{"city": "42", "metric": true, "tags": ["a"]}')]),
    (Qwen3CoderParser, "<tool_call>\n<function=f>\nnot a parameter\n</function>\n</tool_call>",
     "<tool_call>\n<function=f>\nnot a parameter\n</function>\n</tool_call>", []),
    (PythonicParser, '[get_weather(city="Paris", days=2), get_time()]', "",
     [("get_weather", A), ("get_time", "{}")]),
    (PythonicParser, "  [get_weather(city='Paris', days=2)]\n", "", [("get_weather", A)]),
    (PythonicParser, "The list [a(b=1)] is here.", "The list [a(b=1)] is here.", []),
    (PythonicParser, "[1, 2, 3]", "[1, 2, 3]", []),
    (PythonicParser, "[f(x=open('y'))]", "[f(x=open('y'))]", []),  # literal arguments only
    (PythonicParser, "[f(s='a, b)', t=(1, [2, 'x']), u=None), g()]", "",
     [("f", '{"s": "a, b)", "t": [1, [2, "x"]], "u": null}'), ("g", "{}")]),
    (PythonicParser, "[f(1)]", "[f(1)]", []),  # positional arguments: text
    (PythonicParser, "[f(s='it\\'s, ok)', n=-1.5e3, d={'k': (1,)})]", "",
     [("f", '{"s": "it\'s, ok)", "n": -1500.0, "d": {"k": [1]}}')]),
    (GraniteParser, f'Sure. <|tool_call|>[{{"name": "get_weather", "arguments": {A}}}]', "Sure.",
     [("get_weather", A)]),
    (GraniteParser, f'<|tool_call|>[{{"name": "get_weather", "arguments": {A}}}, {{"name": "now", "arguments": {{}}}}]',
     "", [("get_weather", A), ("now", "{}")]),
    (GraniteParser, f' \n[{{"name": "get_weather", "arguments": {A}}}]\n', "", [("get_weather", A)]),  # token skipped
    (GraniteParser, f'<tool_call> [{{"name": "get_weather", "arguments": {A}}}]', "", [("get_weather", A)]),
    (GraniteParser, '<|tool_call|> <tool_call>[{"name": "f", "arguments": "{\\"a\\": 1}"}]', "", [("f", '{"a": 1}')]),
    (GraniteParser, '<|tool_call|>[{"name": "f" "arguments": {}}]', '<|tool_call|>[{"name": "f" "arguments": {}}]',
     []),
    (GraniteParser, "Hm. <tool_call>[{broken", "Hm. <tool_call>[{broken", []),
    (GraniteParser, '<|tool_call|>{"name": "f", "arguments": {}}', '<|tool_call|>{"name": "f", "arguments": {}}', []),
    (GraniteParser, "<|tool_call|>[]", "<|tool_call|>[]", []),
    (GraniteParser, '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {}}</tool_call>', []),  # hermes' form is not granite's
    (GraniteParser, "[1] is the source.", "[1] is the source.", []),
    (GraniteParser, 'See [{"name": "f", "arguments": {}}]', 'See [{"name": "f", "arguments": {}}]', []),
    (GraniteParser, "No calls <|tool_ here.", "No calls <|tool_ here.", []),
    (GraniteParser, "  ", "  ", []),
]


@pytest.mark.parametrize(("cls", "text", "content", "calls"), CASES)
def test_whole_and_every_split_agree(cls, text, content, calls):
    def make(stream=True):
        return cls(stream=stream, schemas={"get_weather": WEATHER})
    whole = make(False)
    parsed = assemble(whole.feed(text) + whole.finish())
    assert (parsed.content, [(n, json.loads(a)) for n, a in calls_of(parsed)]) == \
        (content, [(n, json.loads(a)) for n, a in calls])
    check_stream_matches(make, parsed, text)


def test_parallel_tool_calls_false_keeps_the_first_and_deltas_are_openais():
    output = ToolOutput(parser="pythonic", max_calls=1)
    assert calls_of(output.parse("[f(a=1), g(b=2)]")) == [("f", '{"a": 1}')]
    parser = ToolOutput(parser="qwen3_coder", schemas={"f": {"properties": {"n": {"type": "number"}}}}).new()
    events = []
    for piece in ["<tool_", "call>\n<function=f>\n<parameter=n>\n2.5\n</param", "eter>\n</function>\n</tool_call>"]:
        events += parser.feed(piece)
    events += parser.finish()
    deltas = stream_deltas(events)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert deltas[0]["tool_calls"][0]["id"].startswith("call_")
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"n": 2.5}'}}]}


def test_mistral_keeps_special_tokens_in_the_output():
    from pagedserve.gateway.tools import apply_tools
    from pagedserve.v1 import generate_pb2
    gen = generate_pb2.GenerateRequest(skip_special_tokens=True)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert apply_tools(tools, "auto", None, gen, "mistral").parser == "mistral"
    assert gen.skip_special_tokens is False


QWEN_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
             "</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize(("cls", "text", "block_end"), [
    (DeepSeekV3Parser, "<｜tool▁calls▁begin｜>" + DS_CALL.format(name="get_weather", args=A) + "<｜tool▁calls▁end｜>",
     "<｜tool▁calls▁end｜>"),
    (MistralParser, f"[TOOL_CALLS]get_weather[ARGS]{A}", None),
    (MistralParser, f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {A}}}]', None),
    (PythonicParser, '[get_weather(city="Paris", days=2), get_time()]', None),
    (Qwen3CoderParser, QWEN_CALL, "</tool_call>"),
    (GraniteParser, f'<|tool_call|>[{{"name": "get_weather", "arguments": {A}}}]', None),
    (GraniteParser, f'[{{"name": "get_weather", "arguments": {A}}}, {{"name": "now", "arguments": {{}}}}]', None)])
def test_arguments_stream_as_deltas_before_the_block_ends(cls, text, block_end):
    parser = cls(stream=True, schemas={"get_weather": WEATHER})
    fed, fragments, before_end = "", [], 0
    for ch in text:
        fed += ch
        for event in parser.feed(ch):
            if event.arguments is not None and event.index == 0:
                fragments.append(event.arguments)
                before_end += block_end is not None and block_end not in fed
    fragments += [e.arguments for e in parser.finish() if e.arguments is not None and e.index == 0]
    assert json.loads("".join(fragments)) == json.loads(A)
    assert len(fragments) >= 2 and (block_end is None or before_end >= 1), fragments
    first = stream_deltas(cls(stream=True, schemas={"get_weather": WEATHER}).feed(text))[0]  # OpenAI's shape
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}


def test_granite_reads_like_vllms_and_leaves_the_other_paths_alone():
    """Text after the list makes it content (whole; a stream cannot take back the calls it sent,
    as with every parser); the server's parser is granite: "auto" reads with it, skipping special
    tokens as vLLM does (the bare list is read), "required" and named calls keep their own parsers."""
    from pagedserve.gateway.tools import apply_tools
    from pagedserve.v1 import generate_pb2
    for text in ('<|tool_call|>[{"name": "f", "arguments": {"a": 1}}] and more',
                 '<|tool_call|>[{"name": "f", "arguments": {broken}]'):
        assert GraniteParser.parse(text).content == text and GraniteParser.parse(text).calls == []
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    gen = generate_pb2.GenerateRequest(skip_special_tokens=True)
    auto = apply_tools(tools, "auto", False, gen, "granite")
    assert (auto.parser, auto.max_calls, gen.skip_special_tokens) == ("granite", 1, True)
    assert calls_of(auto.parse('[{"name": "f", "arguments": {"a": 1}}, {"name": "f", "arguments": {}}]')) == \
        [("f", '{"a": 1}')]
    assert isinstance(auto.new(), GraniteParser)
    gen = generate_pb2.GenerateRequest()
    required = apply_tools(tools, "required", None, gen, "granite")
    assert required.required and gen.params.structured_output.json_schema
    assert calls_of(required.parse('[{"name": "f", "parameters": {"a": 1}}]')) == [("f", '{"a": 1}')]
    gen = generate_pb2.GenerateRequest()
    named = apply_tools(tools, {"type": "function", "function": {"name": "f"}}, None, gen, "granite")
    assert calls_of(named.parse('{"a": 1}')) == [("f", '{"a": 1}')]


def test_granite_garbage_never_raises_and_text_without_calls_is_kept():
    import random
    atoms = ["<|tool_call|>", "<tool_call>", "[", "]", "{", "}", '"', "\\", ":", ",", '"name"', '"arguments"',
             '"f"', " ", "\n", "1", "a", "<|tool_"]
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 25)))
        parsed = GraniteParser.parse(text)
        if not parsed.calls:
            assert parsed.content == text
        for pieces in (list(text), [text]):
            parser = GraniteParser(stream=True)
            for piece in pieces:
                parser.feed(piece)
            parser.finish()

"""The tool-call parsers (pagedserve/gateway/tool_parsers.py), driven directly: whole text, and the
same text streamed in every split into two pieces, one character at a time and in seeded random
pieces, which must assemble to the same content and calls."""

from __future__ import annotations

import json
import random

import pytest

from pagedserve.common.settings import setting
from pagedserve.gateway.tool_parsers import (PARSERS, HermesParser, Llama3JsonParser, NamedCallParser,
                                             RequiredCallsParser, assemble)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'


def calls_of(parsed) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parsed.calls]


def splits(text: str, seed: int = 0):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def streamed(make, pieces):
    parser = make()
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return events


def check_stream_matches(make_stream, whole, text):
    """Every split assembles to the whole answer, and a stream never sends a call before its
    name nor splits a name."""
    for pieces in splits(text):
        events = streamed(make_stream, pieces)
        got = assemble(events)
        assert (got.content, calls_of(got)) == (whole.content, calls_of(whole)), pieces
        named = set()
        for e in events:
            if e.name is not None:
                named.add(e.index)
                assert e.id.startswith("call_")
            elif e.arguments is not None:
                assert e.index in named


HERMES_CASES = [
    # (text, content, calls)
    ("Hello there.", "Hello there.", []),
    ("  spaced  \n", "  spaced  \n", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (f"Let me check.\n<tool_call>{WEATHER}</tool_call>", "Let me check.",
     [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (f"<tool_call>{WEATHER}</tool_call>\n<tool_call>"
     '{"name": "now", "arguments": {}}</tool_call>', "", [("get_weather", '{"city": "Paris", "unit": "c"}'),
                                                          ("now", "{}")]),
    # name after the arguments; no arguments at all; nested values with braces in strings
    ('<tool_call>{"arguments": {"q": "a}b{"}, "name": "search"}</tool_call>', "", [("search", '{"q": "a}b{"}')]),
    ('<tool_call>{"name": "ping"}</tool_call>', "", [("ping", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {"xs": [1, {"y": "\\"q\\""}], "z": null}}</tool_call>', "",
     [("f", '{"xs": [1, {"y": "\\"q\\""}], "z": null}')]),
    # no end tag (the model stopped at its end-of-turn token)
    (f"<tool_call>{WEATHER}", "", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    # text after the call is content too
    (f"<tool_call>{WEATHER}</tool_call>\n\nDone.", "Done.", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    # malformed: stays text, exactly
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("<tool_call>[1, 2]</tool_call> ok", "<tool_call>[1, 2]</tool_call> ok", []),
    ("a <tool_ b", "a <tool_ b", []),
    ('x <tool_call>{"name": 3}</tool_call>', 'x <tool_call>{"name": 3}</tool_call>', []),
    # bad escapes in a key or in the name: text, never an exception
    ('<tool_call>{"\\x": 1}</tool_call>', '<tool_call>{"\\x": 1}</tool_call>', []),
    ('<tool_call>{"name": "\\q"}</tool_call>', '<tool_call>{"name": "\\q"}</tool_call>', []),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_whole_and_streamed(text, content, calls):
    whole = HermesParser.parse(text)
    assert (whole.content, calls_of(whole)) == (content, calls)
    check_stream_matches(HermesParser, whole, text)


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "",
     [("a", '{"x": 1}'), ("b", "{}")]),
    ('  {"name": "a", "arguments": {"x": 1}}', "", [("a", '{"x": 1}')]),
    ("The answer is {x}.", "The answer is {x}.", []),
    ('{"name" "a", "parameters": {}}', '{"name" "a", "parameters": {}}', []),
    ('{"name": "a", "parameters": {"x": 1}}; nope', "; nope", [("a", '{"x": 1}')]),
    ("{oops", "{oops", []),
    (" ", " ", []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_json_whole_and_streamed(text, content, calls):
    whole = Llama3JsonParser.parse(text)
    assert (whole.content, calls_of(whole)) == (content, calls)
    check_stream_matches(Llama3JsonParser, whole, text)


def test_stream_sends_the_name_first_then_argument_fragments():
    parser = HermesParser()
    events = []
    for piece in ["Sure. <tool", "_call>{\"na", "me\": \"get_weather\", \"argu", "ments\": {\"city\":",
                  " \"Par", "is\"}}</tool_call>"]:
        events.append(parser.feed(piece))
    events.append(parser.finish())
    assert [e.content for e in events[0]] == ["Sure."]  # the space waits: content or not?
    assert events[1] == [] and events[2][0].name == "get_weather" and events[2][0].index == 0
    fragments = [e.arguments for step in events[3:] for e in step]
    assert fragments == ['{"city":', ' "Par', 'is"}']


def test_max_calls_keeps_the_first():
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>" + '{"name": "now", "arguments": {}}</tool_call>'
    assert calls_of(HermesParser.parse(text, max_calls=1)) == [("get_weather", '{"city": "Paris", "unit": "c"}')]
    whole = HermesParser.parse(text, max_calls=1)
    check_stream_matches(lambda: HermesParser(max_calls=1), whole, text)


def test_a_stream_cannot_take_back_an_announced_call():
    """Documented: a call whose JSON breaks after its name ends with what was sent (whole: text)."""
    text = '<tool_call>{"name": "f", "arguments": {"x": 1} oops</tool_call>'
    assert HermesParser.parse(text).calls == []
    got = assemble(streamed(HermesParser, list(text)))
    assert [(c.name, c.arguments) for c in got.calls] == [("f", '{"x": 1}')] and got.content == "oops</tool_call>"


def test_forced_parsers():
    args = '{"city": "Paris"}'
    for pieces in splits(f" {args} "):
        got = assemble(streamed(lambda: NamedCallParser("get_weather"), pieces))
        assert calls_of(got) == [("get_weather", args)] and got.content == ""
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": [2]}}]'
    whole = RequiredCallsParser.parse(text)
    assert calls_of(whole) == [("a", '{"x": 1}'), ("b", '{"y": [2]}')] and whole.content == ""
    check_stream_matches(RequiredCallsParser, whole, text)
    for pieces in splits(text):
        assert all(json.loads(c.arguments) for c in assemble(streamed(RequiredCallsParser, pieces)).calls)


def test_the_setting_offers_exactly_the_registered_parsers():
    from pagedserve.gateway.tools import ALL_PARSERS
    assert set(setting("gateway", "tool_call_parser").choices) == set(ALL_PARSERS) > set(PARSERS)
    assert set(setting("serve", "tool_call_parser").choices) == set(ALL_PARSERS)


@pytest.mark.parametrize("make", [HermesParser, Llama3JsonParser, RequiredCallsParser,
                                  lambda **kw: NamedCallParser("f", **kw)])
def test_garbage_never_raises_and_text_without_calls_is_kept(make):
    """Seeded random text made of the formats' own pieces (tags, braces, quotes, bad escapes):
    no parser raises, and whole text that yields no call comes back exactly as content."""
    atoms = ["<tool_call>", "</tool_call>", "<|python_tag|>", "{", "}", "[", "]", '"', "\\", "\\x", ":", ",", ";",
             '"name"', '"arguments"', '"parameters"', '"f"', '"\\q"', " ", "\n", "1", "null", "é", "a"]
    rng = random.Random(5)
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 25)))
        whole = make(stream=False)
        parsed = assemble(whole.feed(text) + whole.finish())
        if not parsed.calls:
            assert parsed.content == text
        for pieces in (list(text), [text]):
            streamed(lambda: make(stream=True), pieces)


def test_deep_nesting_is_text_not_an_error():
    text = '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 100000 + "]" * 100000 + "}}</tool_call>"
    assert HermesParser.parse(text).content == text


SPACES = " " * 16  # one token of forced whitespace (tokenizers have runs of up to 16 spaces)
RUN = 128_000  # deltas: 2 MiB of whitespace in one sample


@pytest.mark.parametrize("make, before, after, want", [
    (HermesParser, "a", "b", ("a" + SPACES * RUN + "b", [])),
    (HermesParser, '<tool_call>{"name": "f", "arguments": {"x": ', '1}}</tool_call>',
     ("", [("f", '{"x": ' + SPACES * RUN + "1}")])),
    (Llama3JsonParser, "", '{"name": "f", "parameters": {}}', ("", [("f", "{}")])),
    (Llama3JsonParser, "<|python_tag|>", "hi", ("<|python_tag|>" + SPACES * RUN + "hi", [])),
    (lambda **kw: NamedCallParser("f", **kw), '{"x": 1', "}", ("", [("f", '{"x": 1' + SPACES * RUN + "}")])),
], ids=["hermes-text", "hermes-in-call", "llama3-start", "llama3-after-tag", "named"])
def test_a_run_of_whitespace_costs_its_length_not_its_square(make, before, after, want):
    """Issue 42 row 8: each delta of a long whitespace run once rescanned (and copied) the whole
    run held back, O(L^2) per sample on the gateway's event loop (n=16 samples of 8,000 forced
    space tokens took seconds of the loop). 2 MiB in 128,000 deltas: a linear parser takes a
    fraction of a second; the bound is an order of magnitude above; the quadratic parsers passed
    it after 37,000 to 102,000 deltas (checked as it goes, so that they fail fast)."""
    import time

    parser = make(stream=True)
    events = parser.feed(before)
    started = time.monotonic()
    for i in range(RUN):
        events += parser.feed(SPACES)
        if i % 4096 == 0:
            assert time.monotonic() - started < 4.0, f"{i} deltas took {time.monotonic() - started:.1f} s"
    events += parser.feed(after) + parser.finish()
    assert time.monotonic() - started < 4.0
    parsed = assemble(events)
    assert (parsed.content, calls_of(parsed)) == want

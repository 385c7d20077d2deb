"""xgrammar's structural tag formats (vLLM's newer structural tag) as one llguidance grammar: what each
format lets a model write, read through the default model's tokenizer, and what is refused by path."""

from __future__ import annotations

import json

import pytest

from pagedserve.common import structural_format, structured_output
from pagedserve.common.sampling_params import StructuredOutput

pytestmark = pytest.mark.slow  # the default model's tokenizer

N = {"type": "json_schema", "json_schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                            "required": ["n"], "additionalProperties": False}}


def tag(begin, end, content=N):
    return {"begin": begin, "content": content, "end": end}


def call(name, n):
    return f'<f={name}>{{"n": {n}}}</f>'


F_AB = [tag("<f=a>", "</f>"), tag("<f=b>", "</f>")]
THINK = {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}
# (format, {text: whether the whole text is a complete output of it}); a text missing is refused on the way
CASES = {
    "triggered": ({"type": "triggered_tags", "triggers": ["<f="], "tags": F_AB},
                  {f"hi {call('a', 1)} x {call('b', 2)} end": True, "plain text": True, "hi <f=c>": None,
                   '<f=a>{"n": "x"}': None}),
    "at_least_one": ({"type": "triggered_tags", "triggers": ["<f="], "tags": F_AB, "at_least_one": True},
                     {f"{call('b', 1)} then {call('a', 2)}": True, "": False, f"x{call('a', 1)}": None}),
    "stop_after_first": ({"type": "triggered_tags", "triggers": ["<f="], "tags": F_AB, "stop_after_first": True},
                         {f"pre {call('a', 1)}": True, "only text": True, f"pre {call('a', 1)}more": None}),
    "exactly_one": ({"type": "triggered_tags", "triggers": ["<f="], "tags": F_AB, "at_least_one": True,
                     "stop_after_first": True}, {call("a", 7): True, f"{call('a', 7)} ": None}),
    "think_then_calls": ({"type": "sequence", "elements": [THINK, {"type": "triggered_tags", "triggers": ["<f="],
                                                                    "tags": F_AB}]},
                         {f"<think>a <f=a> b</think>ok {call('a', 3)}": True, "no think": None}),
    "separated": ({"type": "tags_with_separator", "separator": ", ", "tags": [tag("<a>", "</a>"), tag("<b>", "</b>")]},
                  {'<a>{"n": 1}</a>, <b>{"n": 2}</b>': True, "": True, '<a>{"n": 1}</a>x': None}),
    "separated_once": ({"type": "tags_with_separator", "separator": ",", "tags": [tag("<a>", "</a>")],
                        "at_least_one": True, "stop_after_first": True},
                       {'<a>{"n": 1}</a>': True, "": False, '<a>{"n": 1}</a>,': None}),
    "calls_block": ({"type": "triggered_tags", "triggers": ["<calls>"], "stop_after_first": True, "tags": [
        {"begin": "<calls>", "end": "</calls>", "content": {"type": "tags_with_separator", "separator": "\n",
                                                             "tags": [tag("<c>f\n", "</c>")]}}]},
                    {'text<calls><c>f\n{"n": 1}</c>\n<c>f\n{"n": 2}</c></calls>': True, "text<calls></calls>": True,
                     "text<calls><c>g": None}),
    "pieces": ({"type": "sequence", "elements": [
        {"type": "or", "elements": [{"type": "const_string", "value": "yes"}, {"type": "const_string", "value": "no"}]},
        {"type": "regex", "pattern": " [0-9]+/[a-z]+\\/"},
        {"type": "grammar", "grammar": 'root ::= " ok" | " fine"'},
        {"type": "tag", "begin": "[", "content": {"type": "any_text", "excluded_str": ["b.d", "\n"]}, "end": "]"}]},
               {"yes 12/ab/ ok[good]": True, "no 3/x/ fine[b d]": True, "no 3/x/ fine[so b.d]": None,
                "no 3/x/ fine[a\nb]": None, "maybe": None, "yes 1/a/ ok": False}),
    "bool_schema": ({"type": "tag", "begin": "=", "content": {"type": "json_schema", "json_schema": True}, "end": ";"},
                    {'=[1, "a"];': True, "=[1": False}),
}


@pytest.fixture(scope="module")
def tokenizers(default_model_path):
    import llguidance.hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(default_model_path)
    return hf, llguidance.hf.from_tokenizer(hf)


def matcher_after(tokenizers, spec: StructuredOutput, ids: list[int], special=None):
    import llguidance

    matcher = llguidance.LLMatcher(tokenizers[1], structured_output.grammar_text(spec, special), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher, matcher.consume_tokens(ids) and not matcher.is_error()


def held(fmt) -> StructuredOutput:
    spec = StructuredOutput(structural_tag=structured_output.structural_tag_text(
        {"type": "structural_tag", "format": fmt}))
    structured_output.check(spec)
    return spec


@pytest.mark.parametrize("name", CASES)
def test_each_format_takes_what_it_describes(tokenizers, name):
    fmt, texts = CASES[name]
    spec = held(fmt)
    for text, complete in texts.items():
        matcher, taken = matcher_after(tokenizers, spec, tokenizers[0].encode(text, add_special_tokens=False))
        assert taken == (complete is not None), (text, matcher.get_error())
        if taken:
            assert matcher.is_accepting() == complete, text


def test_a_trigger_that_is_a_special_token_is_that_token_at_the_worker(tokenizers):
    hf = tokenizers[0]
    special = {t.content: i for i, t in hf.added_tokens_decoder.items() if t.special}
    start = special["<|im_start|>"]
    spec = held({"type": "triggered_tags", "triggers": ["<|im_start|>"], "tags": [tag("<|im_start|>call", ".")],
                 "at_least_one": True})
    body = hf.encode('call{"n": 5}.', add_special_tokens=False)
    assert f"<[{start}]>" in structured_output.grammar_text(spec, special)
    assert matcher_after(tokenizers, spec, [start, *body, start, *body], special)[1]
    # the trigger's text, not the token, is refused (text lexemes never hold special tokens)
    text = hf.encode("<|im_start|>", add_special_tokens=False, split_special_tokens=True)
    assert not matcher_after(tokenizers, spec, text, special)[1]
    # the gateway, which has no tokenizer, checks the grammar with the trigger as text
    assert "<[" not in structured_output.grammar_text(spec)


def test_special_tokens_in_begins_ends_and_strings_are_those_tokens_at_the_worker(tokenizers):
    """Phi-4-mini's `<|tool_call|>...<|/tool_call|>`, DeepSeek's call markers: a begin or end that holds a
    special token is written as its id (as text the model could never close the tag)."""
    hf = tokenizers[0]
    special = {t.content: i for i, t in hf.added_tokens_decoder.items() if t.special}
    start, end = special["<|im_start|>"], special["<|im_end|>"]
    spec = held({"type": "sequence", "elements": [
        {"type": "tag", "begin": "<|im_start|>think\n", "content": {"type": "any_text"}, "end": "<|im_end|>"},
        {"type": "tags_with_separator", "separator": "<|im_start|>", "at_least_one": True,
         "tags": [tag("<f=a>", "</f><|im_end|>")]}]})

    def ids(text):
        return hf.encode(text, add_special_tokens=False)
    one = [*ids('<f=a>{"n": 1}</f>'), end]
    text = [start, *ids("think\nit has </f> in it"), end, *one, start, *one]
    matcher, taken = matcher_after(tokenizers, spec, text, special)
    assert taken and matcher.is_accepting(), matcher.get_error()
    as_text = hf.encode("<|im_start|>think\nx", add_special_tokens=False, split_special_tokens=True)
    assert not matcher_after(tokenizers, spec, as_text, special)[1]  # its text is not it
    # an end with text before its special token: the text must end with that text, wherever else it appears
    spec = held({"type": "tag", "begin": "<r>", "content": {"type": "any_text"}, "end": "\n<|im_end|>"})
    assert matcher_after(tokenizers, spec, [*ids("<r>a\nb\n"), end], special)[0].is_accepting()
    assert not matcher_after(tokenizers, spec, [*ids("<r>a\nb"), end], special)[1]


def test_the_older_form_is_its_triggered_tags_format(tokenizers):
    older = {"structures": [{"begin": "<f=a>", "schema": N["json_schema"], "end": "</f>"},
                            {"begin": "<f=b>", "end": "</f>"}], "triggers": ["<f="]}
    spec = StructuredOutput(structural_tag=structured_output.structural_tag_text(older))
    for text, taken in ((f"x {call('a', 1)} y <f=b>[1]</f>", True), ('x <f=a>{"n": []}', False)):
        assert matcher_after(tokenizers, spec, tokenizers[0].encode(text, add_special_tokens=False))[1] == taken


def deep(levels: int) -> dict:
    node = {"type": "const_string", "value": "x"}
    for _ in range(levels):
        node = {"type": "sequence", "elements": [node]}
    return node


@pytest.mark.parametrize("fmt, words", [
    ({"type": "qwen_xml_parameter", "json_schema": {}},
     "structural_tag.format.type qwen_xml_parameter is not supported"),
    ({"type": "bogus"}, "structural_tag.format.type must be one of const_string"),
    ({"type": "tag", "begin": "<a>", "end": "</a>"}, "a tag format needs content"),
    ({"type": "const_string", "value": "x", "extra": 1}, "a const_string format has no field 'extra'"),
    ({"type": "sequence", "elements": []}, "structural_tag.format.elements must be a non-empty list"),
    ({"type": "or", "elements": [{"type": "regex", "pattern": ""}]}, "format.elements[0].pattern must be a non-empty"),
    ({"type": "triggered_tags", "triggers": ["<f="], "tags": [tag("<g>", "</g>")]},
     "format.tags[0].begin '<g>' does not start with any of the triggers"),
    ({"type": "triggered_tags", "triggers": ["<f="], "tags": [{"type": "const_string", "value": "<f="}]},
     "format.tags[0] must be a tag format"),
    ({"type": "tags_with_separator", "separator": ",", "tags": [tag("<a>", "</a>")], "at_least_one": "yes"},
     "format.at_least_one must be true or false"),
    ({"type": "any_text", "excluded_str": [""]}, "format.excluded_str must be a list of non-empty strings"),
    ({"type": "json_schema", "json_schema": "{}"}, "format.json_schema must be a JSON Schema object"),
    ({"type": "tag", "begin": "<a>", "end": "</a>", "content": {"type": "json_schema",
                                                                "json_schema": {"type": "bogus"}}}, "bogus"),
    ({"type": "grammar", "grammar": "root ::= ("}, "structural_tag"),
    (deep(structural_format.MAX_DEPTH + 1), f"formats nest deeper than {structural_format.MAX_DEPTH}"),
])
def test_a_bad_format_is_refused_naming_its_path(fmt, words):
    with pytest.raises(ValueError) as info:
        structured_output.check(StructuredOutput(structural_tag=structured_output.structural_tag_text(
            {"type": "structural_tag", "format": fmt})))
    assert words in str(info.value)


def test_formats_as_deep_as_allowed_compile():
    structured_output.check(StructuredOutput(structural_tag=structured_output.structural_tag_text(
        json.dumps({"type": "structural_tag", "format": deep(structural_format.MAX_DEPTH)}))))

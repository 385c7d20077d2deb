"""xgrammar's structural tag formats (`{"type": "structural_tag", "format": {...}}`, vLLM's newer form
of the structural tag) checked, and written as one llguidance grammar. vLLM's older form
(`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`) is the `triggered_tags` format of
its structures (xgrammar's own reading), so both forms are checked (held_text) and compiled here.

A format is a tree of nodes, each a piece of the output:
- `const_string` {value}: that text; `json_schema` {json_schema}: JSON under the schema, compact as
  every JSON here (common/structured_output.py); `regex` {pattern}; `grammar` {grammar}: a Lark or
  GBNF grammar (a side grammar, `@name`); `any_text` {excluded_str}: any text without those strings;
- `sequence` / `or` {elements}: one after another / one of them;
- `tag` {begin, content, end}: the begin text, the content, the end text. Its content `any_text`
  ends at the first end text (a lazy lexeme): a reasoning block `<think>...</think>`;
- `triggered_tags` {triggers, tags, at_least_one, stop_after_first}: free text until a trigger (a
  prefix of some tags' begin), then that tag, then free text again; at_least_one: the output starts
  with a tag; stop_after_first: nothing after the first tag;
- `tags_with_separator` {tags, separator, at_least_one, stop_after_first}: tags joined by the
  separator, nothing else.
In every text the format writes (a trigger, a begin, an end, a separator, a const string), a special
token of the vocabulary (`<|python_tag|>`, `<|im_end|>`) is that token, by id, at the worker, which
knows the tokenizer (a model writes it as one id, and text never matches one); the gateway checks the
grammar with them as text.
xgrammar's `qwen_xml_parameter` is refused by name. Unknown fields are refused (400 naming the
path) rather than dropped. Pure functions, no tokenizer.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 16  # nesting of formats (a tool call's tags inside a triggered tag are 3)
_FIELDS = {
    "const_string": ({"value"}, set()), "json_schema": ({"json_schema"}, set()), "regex": ({"pattern"}, set()),
    "grammar": ({"grammar"}, set()), "any_text": (set(), {"excluded_str"}), "sequence": ({"elements"}, set()),
    "or": ({"elements"}, set()), "tag": ({"begin", "content", "end"}, set()),
    "triggered_tags": ({"triggers", "tags"}, {"at_least_one", "stop_after_first"}),
    "tags_with_separator": ({"tags", "separator"}, {"at_least_one", "stop_after_first"}),
}
_TEXT = r"(.|\n)*"
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")
# the JSON a json_schema node writes: compact, as common/structured_output's json_schema
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def held_text(value: object) -> str:
    """vLLM's structural tag, either form (the older {"structures": [{"begin", "schema", "end"}, ...],
    "triggers": [...]}, or {"type": "structural_tag", "format": ...}), as an object or its JSON, in the one
    form StructuredOutput.structural_tag holds; raises ValueError naming what is wrong. Every structure's
    begin starts with a trigger (the text that switches from free text to the structure); a structure
    without a schema takes any JSON value."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structural_tag is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"structural_tag must be an object, got {type(value).__name__}")
    if "format" in value:  # xgrammar's formats (vLLM's newer form)
        return json.dumps(checked(value))
    unknown = sorted(set(value) - {"type", "structures", "triggers"})
    if unknown:
        raise ValueError(f"structural_tag takes structures and triggers (vLLM's form), not {', '.join(unknown)}")
    triggers, structures = value.get("triggers"), value.get("structures")
    if not isinstance(triggers, list) or not triggers or any(not isinstance(t, str) or not t for t in triggers):
        raise ValueError("structural_tag.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag.structures must be a non-empty list of {begin, schema, end}")
    out = []
    for i, item in enumerate(structures):
        where = f"structural_tag.structures[{i}]"
        if not isinstance(item, dict) or set(item) - {"begin", "schema", "end"}:
            raise ValueError(f"{where} must be an object of begin, schema and end")
        begin, end, schema = item.get("begin"), item.get("end"), item.get("schema")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise ValueError(f"{where}: begin and end must be strings")
        if not any(begin.startswith(t) for t in triggers):
            raise ValueError(f"{where}.begin {begin!r} does not start with any of the triggers {triggers!r}")
        if schema is not None and not isinstance(schema, (dict, bool)):
            raise ValueError(f"{where}.schema must be a JSON Schema object, got {type(schema).__name__}")
        out.append({"begin": begin, "schema": {} if schema is None else schema, "end": end})
    return json.dumps({"structures": out, "triggers": triggers})


def as_format(text: str) -> dict:
    """A held structural tag (held_text's) as a format: the older form as its triggered_tags format."""
    tag = json.loads(text)
    return tag if "format" in tag else from_structures(tag["structures"], tag["triggers"])


def checked(value: Any, where: str = "structural_tag") -> dict:
    """{"type": "structural_tag", "format": ...} with every node checked (types, fields, every tag's
    begin starting with a trigger); raises ValueError naming the node's path."""
    unknown = sorted(set(value) - {"type", "format"})
    if unknown:
        raise ValueError(f"{where}: a structural tag with a format takes type and format, not {', '.join(unknown)}")
    if value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"{where}.type must be \"structural_tag\", got {value.get('type')!r}")
    return {"type": "structural_tag", "format": _node(value.get("format"), f"{where}.format", 0)}


def from_structures(structures: list[dict], triggers: list[str]) -> dict:
    """vLLM's older structural tag (checked by common/structured_output) as its triggered_tags format."""
    tags = [{"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
             "end": s["end"]} for s in structures]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags,
                                                 "at_least_one": False, "stop_after_first": False}}


def _node(node: Any, where: str, depth: int, kind: str | None = None) -> dict:
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: formats nest deeper than {MAX_DEPTH}")
    if not isinstance(node, dict):
        raise ValueError(f"{where} must be a format object, got {type(node).__name__}")
    kind = node.get("type", kind)
    if kind == "qwen_xml_parameter":
        raise ValueError(f"{where}.type qwen_xml_parameter is not supported by this server")
    if kind not in _FIELDS:
        raise ValueError(f"{where}.type must be one of {', '.join(_FIELDS)}, got {kind!r}")
    required, optional = _FIELDS[kind]
    extra = sorted(set(node) - required - optional - {"type"})
    if extra:
        raise ValueError(f"{where}: a {kind} format has no field {extra[0]!r}")
    missing = sorted(required - set(node))
    if missing:
        raise ValueError(f"{where}: a {kind} format needs {', '.join(missing)}")
    return {"type": kind, **_fields(kind, node, where, depth)}


def _text(value: Any, where: str, empty: bool = True) -> str:
    if not isinstance(value, str) or not (empty or value):
        raise ValueError(f"{where} must be a {'' if empty else 'non-empty '}string")
    return value


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where} must be true or false")
    return value


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list")
    return value


def _fields(kind: str, node: dict, where: str, depth: int) -> dict:
    if kind == "const_string":
        return {"value": _text(node["value"], f"{where}.value")}
    if kind == "json_schema":
        schema = node["json_schema"]
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{where}.json_schema must be a JSON Schema object, got {type(schema).__name__}")
        return {"json_schema": schema}
    if kind in ("regex", "grammar"):
        name = "pattern" if kind == "regex" else "grammar"
        return {name: _text(node[name], f"{where}.{name}", empty=False)}
    if kind == "any_text":
        excluded = node.get("excluded_str", [])
        if not isinstance(excluded, list) or any(not isinstance(s, str) or not s for s in excluded):
            raise ValueError(f"{where}.excluded_str must be a list of non-empty strings")
        return {"excluded_str": excluded}
    if kind in ("sequence", "or"):
        elements = _list(node["elements"], f"{where}.elements")
        return {"elements": [_node(e, f"{where}.elements[{i}]", depth + 1) for i, e in enumerate(elements)]}
    if kind == "tag":
        return {"begin": _text(node["begin"], f"{where}.begin"),
                "content": _node(node["content"], f"{where}.content", depth + 1),
                "end": _text(node["end"], f"{where}.end")}
    listed = _list(node["tags"], f"{where}.tags")
    tags = [_node(t, f"{where}.tags[{i}]", depth + 1, "tag") for i, t in enumerate(listed)]
    for i, tag in enumerate(tags):
        if tag["type"] != "tag":
            raise ValueError(f"{where}.tags[{i}] must be a tag format, got {tag['type']!r}")
    out = {"tags": tags, "at_least_one": _flag(node.get("at_least_one", False), f"{where}.at_least_one"),
           "stop_after_first": _flag(node.get("stop_after_first", False), f"{where}.stop_after_first")}
    if kind == "tags_with_separator":
        return {**out, "separator": _text(node["separator"], f"{where}.separator")}
    triggers = _list(node["triggers"], f"{where}.triggers")
    for i, trigger in enumerate(triggers):
        _text(trigger, f"{where}.triggers[{i}]", empty=False)
    for i, tag in enumerate(tags):
        if not any(tag["begin"].startswith(t) for t in triggers):
            raise ValueError(f"{where}.tags[{i}].begin {tag['begin']!r} does not start with any of the triggers "
                             f"{triggers!r}")
    return {**out, "triggers": triggers}


def literals(fmt: dict) -> set[str]:
    """Every text the format writes as given (triggers, begins, ends, separators, const strings): the
    worker matches the special tokens among them as their ids."""
    found: set[str] = set()
    stack = [fmt["format"]]
    while stack:
        node = stack.pop()
        found.update(node.get("triggers", ()))
        found.update(node[k] for k in ("begin", "end", "separator", "value") if node.get(k))
        stack += node.get("elements", []) + node.get("tags", []) + ([node["content"]] if "content" in node else [])
    return found


def grammar(fmt: dict, special: dict[str, int]) -> str:
    """The checked format as llguidance's grammar: Lark text, or (with `grammar` nodes, each a side
    grammar) llguidance's JSON of several grammars. special: special token text -> id (the worker's)."""
    writer = _Writer(special)
    start = writer.rule(fmt["format"])
    main = "\n".join(["%llguidance {}", f"start: {start}", f"TEXT: /{_TEXT}/", *writer.lines]) + "\n"
    if not writer.sides:
        return main
    return json.dumps({"grammars": [{"name": "structural_tag", "lark_grammar": main}, *writer.sides]})


def _literal(text: str) -> str:
    return json.dumps(text) if text else '""'


def _escaped(text: str) -> str:
    """text as a regex matching itself, inside a Lark /.../ (whose lines may not break)."""
    return _one_line("".join("\\" + c if c in _REGEX_META else c for c in text))


def _one_line(pattern: str) -> str:
    return pattern.replace("\n", "\\n").replace("\r", "\\r")


class _Writer:
    """Lark rules for a format tree: each node a rule named by a counter (n1, n2, ...)."""

    def __init__(self, special: dict[str, int]) -> None:
        self.special = special
        # the special tokens' texts, longest first: a literal holding one is that token there, by id
        self._split = re.compile("(" + "|".join(map(re.escape, sorted(special, key=len, reverse=True))) + ")") \
            if special else None
        self.lines: list[str] = []
        self.sides: list[dict] = []
        self.count = 0

    def _name(self) -> str:
        self.count += 1
        return f"n{self.count}"

    def _text(self, text: str) -> str:
        """A literal as Lark: its special tokens' texts as those tokens (a model writes them as one id; text
        lexemes never hold them), the rest as strings."""
        if self._split is None or not text:
            return _literal(text)
        pieces = [p for p in self._split.split(text) if p]
        return " ".join(f"<[{self.special[p]}]>" if p in self.special else _literal(p) for p in pieces)

    def _first_special(self, text: str) -> int:
        """Where the first special token's text starts in text (-1: none)."""
        found = self._split.search(text) if self._split is not None else None
        return found.start() if found else -1

    def _define(self, body: str, lazy: bool = False) -> str:
        name = self._name()
        self.lines.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def _any_text(self, excluded: list[str], ending: str = "") -> str:
        """A text lexeme: any text without the excluded strings, ending with `ending`."""
        if not excluded and not ending:
            return "TEXT"
        name = self._name().upper()
        text = f"/{_TEXT}{_escaped(ending)}/"
        if excluded:
            text += f" & ~/{_TEXT}({'|'.join(_escaped(s) for s in excluded)}){_TEXT}/"
        self.lines.append(f"{name}: {text}")
        return name

    def rule(self, node: dict) -> str:
        kind = node["type"]
        if kind == "const_string":
            return self._define(self._text(node["value"]))
        if kind == "json_schema":
            schema = node["json_schema"]
            if isinstance(schema, bool):
                schema = {} if schema else {"not": {}}
            schema = {**schema, "x-guidance": {**JSON_DEFAULTS, **schema.get("x-guidance", {})}}
            return self._define("%json " + json.dumps(schema))
        if kind == "regex":
            pattern = re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", _one_line(node["pattern"]))  # an unescaped /
            return self._define(f"/{pattern}/")
        if kind == "grammar":
            from llguidance.gbnf_to_lark import any_to_lark
            try:
                lark = any_to_lark(node["grammar"])
            except Exception as exc:  # noqa: BLE001 - llguidance's converter raises its own kinds
                raise ValueError(f"a grammar format does not convert to Lark: {exc}") from None
            name = f"g{len(self.sides)}"
            self.sides.append({"name": name, "lark_grammar": lark})
            return self._define("@" + name)
        if kind == "any_text":
            return self._define(self._any_text(node["excluded_str"]))
        if kind in ("sequence", "or"):
            parts = [self.rule(e) for e in node["elements"]]
            return self._define((" " if kind == "sequence" else " | ").join(parts))
        if kind == "tag":
            return self._tag(node)
        if kind == "tags_with_separator":
            return self._separated(node)
        return self._triggered(node)

    def _begin(self, tag: dict, triggers: list[str], after_text: bool) -> str:
        """A triggered tag's begin: its trigger (a special token by id; after free text, the text and the
        trigger as one lazy lexeme, which ends at the trigger's first appearance), then the rest."""
        trigger = max((t for t in triggers if tag["begin"].startswith(t)), key=len)
        rest = tag["begin"][len(trigger):]
        if trigger in self.special:
            head = f"{'TEXT ' if after_text else ''}<[{self.special[trigger]}]>"
        elif after_text:
            head = self._define(f"TEXT {_literal(trigger)}", lazy=True)
        else:
            head = self._text(trigger)
        return f"{head} {self._text(rest)}" if rest else head

    def _tag(self, node: dict, begin: str | None = None) -> str:
        """begin content end; `begin` (a triggered tag's, _begin) replaces the literal."""
        head = begin if begin is not None else self._text(node["begin"])
        content, end = node["content"], node["end"]
        if content["type"] == "any_text" and end:  # the text up to the first end
            at = self._first_special(end)
            if at >= 0:  # a special token ends the text by itself (text never holds one); the text ends with
                # what the end has before it
                text = self._any_text(content["excluded_str"], end[:at])
                return self._define(f"{head} {text} {self._text(end[at:])}")
            body = self._define(f"{self._any_text(content['excluded_str'])} {_literal(end)}", lazy=True)
            return self._define(f"{head} {body}")
        return self._define(f"{head} {self.rule(content)} {self._text(end)}")

    def _separated(self, node: dict) -> str:
        one = self._define(" | ".join(self._tag(t) for t in node["tags"]))
        if node["stop_after_first"]:
            return self._define(one if node["at_least_one"] else f"{one}?")
        many = f"{one} ({self._text(node['separator'])} {one})*"
        return self._define(many if node["at_least_one"] else f"({many})?")

    def _triggered(self, node: dict) -> str:
        tags, triggers = node["tags"], node["triggers"]
        through_text = self._define(" | ".join(self._tag(t, self._begin(t, triggers, True)) for t in tags))
        if node["at_least_one"]:  # the output starts with a tag
            first = self._define(" | ".join(self._tag(t, self._begin(t, triggers, False)) for t in tags))
            return self._define(first if node["stop_after_first"] else f"{first} {through_text}* TEXT")
        return self._define(f"TEXT | {through_text}" if node["stop_after_first"] else f"{through_text}* TEXT")

"""vLLM's ways of asking for a constraint on the output, as one StructuredOutput: the keys and
options of its `structured_outputs` object (the HTTP field, and the offline API's
StructuredOutputsParams / older GuidedDecodingParams) and its older `guided_*` values.

Written once for the gateway (gateway/structured.py, which answers 400 naming the field) and the
offline API (common/offline_types.py, which raises ValueError). Pure functions: each raises
ValueError whose message names the field path it was given (`where`); compiling the spec is
common/structured_output.check's.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.common import structured_output
from pagedserve.common.sampling_params import StructuredOutput

OFF = (None, False, "", [], {})  # the values that mean "not set"
# structured_outputs' constraint kinds -> StructuredOutput's field
KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
         "json_object": "json_object", "structural_tag": "structural_tag"}
# its options, with the values pagedserve takes: disable_fallback (one grammar engine, nothing to fall
# back to) and disable_any_whitespace (JSON is always compact here) are what it does anyway;
# disable_additional_properties is applied (closed_objects); the others only off.
OPTIONS = {"disable_fallback": (*OFF, True), "disable_any_whitespace": (*OFF, True),
           "disable_additional_properties": (*OFF, True), "whitespace_pattern": OFF,
           "backend": (*OFF, "auto", "guidance"), "_backend": OFF, "_backend_was_auto": OFF}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema


def is_off(value: Any, off: tuple = OFF) -> bool:
    return any(value is v or (type(value) is type(v) and value == v) for v in off)


def guided(kind: str, value: Any, where: str) -> StructuredOutput:
    """One constraint of a KINDS kind, its value checked (not compiled)."""
    if kind == "json":
        return StructuredOutput(json_schema=structured_output.schema_text(value, where))
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "structural_tag":
        try:
            return StructuredOutput(structural_tag=structured_output.structural_tag_text(value))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    if kind == "choice":
        if not isinstance(value, list) or not value or any(not isinstance(c, str) or not c for c in value):
            raise ValueError(f"{where} must be a non-empty list of non-empty strings")
        return StructuredOutput(choice=list(value))
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty string")
    return StructuredOutput(**{KINDS[kind]: value})


def from_structured_outputs(so: dict, where: str = "structured_outputs") -> StructuredOutput:
    """vLLM's structured_outputs object (exactly one kind set; options as OPTIONS allows)."""
    for key, value in so.items():
        if key in OPTIONS and not is_off(value, OPTIONS[key]):
            raise ValueError(f"{where}.{key} is not supported by this server (got {value!r})")
        if key not in OPTIONS and key not in KINDS:
            raise ValueError(f"{where}.{key} is not a known field; use one of {', '.join(KINDS)}")
    kinds = [k for k in KINDS if k in so and not is_off(so[k])]
    if len(kinds) != 1:
        raise ValueError(f"{where} must set exactly one of {', '.join(KINDS)}, got {', '.join(kinds) or 'none'}")
    spec = guided(kinds[0], so[kinds[0]], f"{where}.{kinds[0]}")
    if so.get("disable_additional_properties") and spec.json_schema:
        spec.json_schema = json.dumps(closed_objects(json.loads(spec.json_schema)))
    return spec


def closed_objects(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema that lists properties and says
    nothing of others gets additionalProperties false (property maps walked as maps of schemas)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: {name: closed_objects(sub) for name, sub in value.items()}
           if key in _SCHEMA_MAPS and isinstance(value, dict) else closed_objects(value)
           for key, value in schema.items()}
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out

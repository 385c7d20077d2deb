"""The request fields that constrain what is sampled, mapped onto SamplingParams: structured
outputs (OpenAI's `response_format`, vLLM's `structured_outputs` and the older `guided_*`
fields), `logit_bias`; and the vLLM/OpenAI extension fields that pagedserve does not support,
which are refused by name instead of being dropped like unknown fields.

Everything here runs before anything is sent downstream (400 naming the field). Pure functions;
vLLM's fields are read by pagedserve.common.vllm_structured (shared with the offline API), the
grammar check itself is pagedserve.common.structured_output's (cached per spec).
"""

from __future__ import annotations

from typing import Any

from pagedserve.common import structured_output, vllm_structured
from pagedserve.common.sampling_params import LOGIT_BIAS_LIMIT, StructuredOutput
from pagedserve.gateway.errors import bad_request
from pagedserve.v1 import common_pb2

# vLLM's (and OpenAI's legacy) request fields that pagedserve does not implement, with the values
# that mean "off" and are accepted silently. A field a request model declares is not checked here
# (it is supported), so a field that becomes supported only has to be declared.
_OFF = vllm_structured.OFF
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "early_stopping": _OFF,
    "spaces_between_special_tokens": (*_OFF, True), "prompt_logprobs": _OFF,
    "logits_processors": _OFF,
    "guided_whitespace_pattern": _OFF, "guided_decoding_backend": (*_OFF, "auto", "guidance", "llguidance"),
    "chat_template": _OFF, "chat_template_kwargs": _OFF, "continue_final_message": _OFF,
    "mm_processor_kwargs": _OFF, "kv_transfer_params": _OFF, "vllm_xargs": _OFF,
    "functions": _OFF, "function_call": _OFF,  # OpenAI's legacy function calling
}


def _bad(message: str, param: str):
    return bad_request(message, param)


def check_unsupported(data: Any, declared: set[str]) -> None:
    """400 naming the first known extension field the body sets that pagedserve does not support."""
    if not isinstance(data, dict):
        return
    for name, off in UNSUPPORTED_FIELDS.items():
        if name in data and name not in declared and not vllm_structured.is_off(data[name], off):
            raise _bad(f"{name} is not supported by this server (got {data[name]!r}); leave it out", name)


def _from_response_format(rf: dict) -> tuple[str, StructuredOutput | None]:
    kind = rf.get("type", "text")
    if kind == "text":
        return "response_format", None
    if kind == "json_object":
        return "response_format", StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "json_schema" not in spec:
            raise _bad("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       "response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        return "response_format", _vllm(lambda: StructuredOutput(
            json_schema=structured_output.schema_text(schema, "response_format.json_schema")))
    if kind == "structural_tag":
        return "response_format", _structural_tag(rf, "response_format")
    raise _bad(f"response_format type must be text, json_object, json_schema or structural_tag, got {kind!r}",
               "response_format")


def _structural_tag(value: Any, param: str) -> StructuredOutput:
    return _vllm(vllm_structured.guided, "structural_tag", value, param)


def _vllm(convert, *args) -> StructuredOutput:
    """A vllm_structured conversion; its ValueError as a 400 naming the field (the path's first part)."""
    try:
        return convert(*args)
    except ValueError as exc:
        message = str(exc)
        raise _bad(message, message.split()[0].split(".")[0].rstrip(":")) from None


_CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "structural_tag", "tools")


def compiles_a_grammar(req: Any) -> bool:
    """Whether mapping the request may compile a grammar (a constraint, or tools whose tool_choice
    forces one): up to seconds of llguidance for a large schema, which releases the GIL, so the
    gateway maps such a request on a worker thread, off the event loop every stream shares."""
    return any(getattr(req, name, None) for name in _CONSTRAINT_FIELDS)


def structured_output_of(req: Any) -> StructuredOutput | None:
    """The one constraint the request asks for (None: free text); 400 when it asks for two or
    when the spec does not compile."""
    found: list[tuple[str, StructuredOutput]] = []
    if req.response_format:
        where, spec = _from_response_format(req.response_format)
        if spec is not None:
            found.append((where, spec))
    if req.structured_outputs:
        found.append(("structured_outputs", _vllm(vllm_structured.from_structured_outputs, req.structured_outputs)))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", _vllm(vllm_structured.guided, kind, value, f"guided_{kind}")))
    if req.structural_tag is not None:  # vLLM's older top-level field: the tag as a JSON string
        found.append(("structural_tag", _structural_tag(req.structural_tag, "structural_tag")))
    if not found:
        return None
    if len(found) > 1:
        raise _bad(f"only one structured output constraint per request, got {', '.join(w for w, _ in found)}",
                   found[1][0])
    where, spec = found[0]
    try:
        structured_output.check(spec)
    except ValueError as exc:
        raise _bad(f"{where}: {exc}", where) from None
    return spec


def fill(req: Any, params: common_pb2.SamplingParams) -> None:
    """Sets params.structured_output and params.logit_bias from the request (validated)."""
    spec = structured_output_of(req)
    if spec is not None:
        out = params.structured_output
        out.SetInParent()
        out.json_schema, out.json_object, out.regex, out.grammar = (spec.json_schema, spec.json_object,
                                                                    spec.regex, spec.grammar)
        out.structural_tag = spec.structural_tag
        out.choice[:] = spec.choice
    for key, bias in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise _bad(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < 2**32:
            raise _bad(f"logit_bias token id {token} is outside the vocabulary", "logit_bias")
        # OpenAI's range; larger values are clipped to it as vLLM does.
        params.logit_bias[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(bias)))


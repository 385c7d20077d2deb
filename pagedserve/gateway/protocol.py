"""OpenAI's completions and chat request shapes, and their mapping onto a GenerateRequest.

Validation happens here, before anything is sent downstream, so that a bad parameter is a 400
naming the parameter rather than a gRPC error from some later stage.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from pagedserve.common.sampling_params import MAX_BAD_WORDS, SamplingParams, size_problem
from pagedserve.gateway import structured
from pagedserve.gateway.errors import RequestError, bad_request, error_body, internal_error  # noqa: F401 (their home)
from pagedserve.gateway.images import message_content, message_text
from pagedserve.gateway.tools import history_fields
from pagedserve.v1 import generate_pb2

log = logging.getLogger("pagedserve.gateway")

# Only for validating min_tokens <= max_tokens when the client left max_tokens unset (that means
# "up to the context", which the scheduler knows and we do not).
_UNBOUNDED = 2**31 - 1
UINT32_MAX = 2**32 - 1
# vLLM's completions endpoint, like OpenAI's, generates 16 tokens when max_tokens is not sent.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage of its choice so far as well.
    continuous_usage_stats: bool = False
    # pagedserve's own, opt-in: each SSE event carries an `id:` line (the resume cursor for
    # GET /v1/requests/{id}/stream with Last-Event-ID). Off by default: OpenAI's streams have no
    # `id:` field and naive readers (vLLM's bench client) parse every non-`data: ` line as JSON.
    include_event_ids: bool = False


def unencodable_path(value: Any, path: str = "") -> str | None:
    """The path of the first string in value (JSON data) that is not valid Unicode (a lone UTF-16
    surrogate, which JSON's \\uD800 escapes can carry): protobuf, Redis and the tokenizer all
    need UTF-8. None when every string encodes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and unencodable_path(key) is not None:
            return path or "body"
        found = unencodable_path(item, f"{path}.{key}" if path and isinstance(key, str) else
                                 f"{path}[{key}]" if path else str(key))
        if found is not None:
            return found
    return None


class _SamplingFields(BaseModel):
    # Clients send fields we do not know (OpenAI adds them often); ignoring them is what vLLM does.
    # No Infinity or NaN anywhere (Python's JSON parser accepts them; they mean nothing here).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = unencodable_path(data)
        if where is not None:
            raise ValueError(f"{where} is not valid Unicode (a lone UTF-16 surrogate); strings must encode as UTF-8")
        return data

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    # vLLM's: the request shares prefix-cache blocks only with requests of the same salt (within
    # its owner's: gateway/owners.cache_salt).
    cache_salt: str | None = None
    # pagedserve's own: the response carries a "timings" object (the final chunk when streaming).
    timings: bool = False
    # pagedserve's own: a deadline in seconds; when it passes the request is aborted (its KV blocks
    # freed) and answered 504 (in-band error event when streaming).
    timeout: float | None = None
    # Structured outputs (gateway/structured.py): OpenAI's, vLLM's and vLLM's older names.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None
    # vLLM's: the prompt's and each choice's token ids in the response (responses.py), and logprob
    # tokens as "token_id:<id>" (unset: the server's --return-tokens-as-token-ids).
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: only the prompt's last k tokens are read (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = None
    # vLLM's beam search (gateway/beam_call.py): n beams, scored by cum logprob / length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: only these tokens may be generated / these words never are
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        structured.check_unsupported(data, set(cls.model_fields))  # known extensions: 400, not dropped
        return data


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: each choice's "prompt_logprobs"


class TextPart(BaseModel):
    """A content part: text, or image_url ({"url", "detail"} or the url string: gateway/images.py)."""
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None
    image_url: str | dict[str, Any] | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the model continues the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    chat_template: str | None = None  # vLLM's per-request template: refused (the server's is --chat-template)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    prompt_logprobs: int | None = None  # vLLM's: the response's "prompt_logprobs" (the templated prompt)
    echo: bool = False  # vLLM's: the answer starts with the last message's content when it is the assistant's
    documents: list[dict[str, str]] | None = None  # vLLM's: the chat template's `documents` (RAG templates)


_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the text an answer starts with, the last message's content when that message
    is the assistant's (the answer's role), else nothing."""
    last = req.messages[-1] if req.echo and req.messages else None
    return message_text(last.content, f"messages[{len(req.messages) - 1}]") if last and last.role == "assistant" \
        else ""


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(s == "" for s in stops):
        raise bad_request("stop must not contain an empty string", "stop")
    return stops


def _check_bad_words(words: list[str] | None) -> None:
    """Each a word (the tokenizer checks their token lengths); at most MAX_BAD_WORDS."""
    if len(words or ()) > MAX_BAD_WORDS:
        raise bad_request(f"bad_words has {len(words)} words: at most {MAX_BAD_WORDS}", "bad_words")
    for i, word in enumerate(words or ()):
        if not word.strip():
            raise bad_request(f"bad_words[{i}] must be a word (a non-blank string), got {word!r}", "bad_words")


def _check_uint32(value: int, name: str) -> None:
    if not 0 <= value <= UINT32_MAX:
        raise bad_request(f"{name} must be a non-negative 32-bit integer, got {value!r}", name)


def _fill_params(req: _SamplingFields, gen: generate_pb2.GenerateRequest, max_tokens: int | None,
                 logprobs: int | None, prompt_logprobs: int | None = None, echo: bool = False) -> None:
    """Validate with the engine's own rules, then set only what the client sent."""
    if max_tokens == 0 and not echo:  # as vLLM: the prompt alone is an echo's answer only
        raise bad_request("max_tokens must be at least 1 (0 is accepted only with echo on /v1/completions)",
                          "max_tokens")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (it must equal n when sent)", "best_of")
    too_many = size_problem(len(req.logit_bias or ()), len(req.stop_token_ids or ()))
    if too_many:
        raise bad_request(too_many, too_many.split(" ", 1)[0])
    check = {"n": req.n, "max_tokens": _UNBOUNDED if max_tokens is None else max_tokens,
             "min_tokens": req.min_tokens, "stop_token_ids": list(req.stop_token_ids or []),
             "logprobs": logprobs, "prompt_logprobs": prompt_logprobs, "cache_salt": req.cache_salt or "",
             "allowed_token_ids": req.allowed_token_ids}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed"):
        if getattr(req, name) is not None:
            check[name] = getattr(req, name)
    try:
        SamplingParams(**check)
    except ValueError as exc:
        message = str(exc)
        raise bad_request(message, message.split(" ", 1)[0]) from exc
    if max_tokens is not None:
        _check_uint32(max_tokens, "max_tokens")
    for name in ("stop_token_ids", "allowed_token_ids"):
        for token in getattr(req, name) or []:
            _check_uint32(token, name)
    _check_bad_words(req.bad_words)
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise bad_request("seed must be a 64-bit integer", "seed")
    if not -(2**31) <= req.priority < 2**31:
        raise bad_request("priority must be a 32-bit integer", "priority")

    p = gen.params
    p.n = req.n
    # Unsent: the tokenizer gives them the model's defaults (common/sampling_defaults.py), else the engine's.
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed"):
        if getattr(req, name) is not None:
            setattr(p, name, getattr(req, name))
    # Zero is both the proto default and the engine's "off" for these.
    p.presence_penalty = req.presence_penalty or 0.0
    p.frequency_penalty = req.frequency_penalty or 0.0
    if max_tokens is not None:
        p.max_tokens = max_tokens
    p.min_tokens = req.min_tokens
    p.stop_token_ids[:] = list(req.stop_token_ids or [])
    p.ignore_eos = req.ignore_eos
    if logprobs is not None:
        p.logprobs = logprobs
    if prompt_logprobs is not None:
        p.prompt_logprobs = prompt_logprobs
    p.cache_salt = req.cache_salt or ""  # the client's: the gateway salts it with the owner
    p.allowed_token_ids[:] = req.allowed_token_ids or []
    gen.bad_words[:] = req.bad_words or []
    structured.fill(req, p)
    gen.stop[:] = _stop_strings(req.stop)
    gen.include_stop_str_in_output = req.include_stop_str_in_output
    gen.skip_special_tokens = req.skip_special_tokens
    gen.priority = req.priority
    gen.model = req.model or ""


def completion_to_generate(req: CompletionRequest) -> generate_pb2.GenerateRequest:
    gen = generate_pb2.GenerateRequest()
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("batched prompts are not supported: send one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        gen.prompt = prompt
    else:
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        for token in prompt:
            _check_uint32(token, "prompt")
        gen.prompt_token_ids.ids[:] = prompt
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    # As vLLM: echo with logprobs covers the prompt too, at the same top k, unless prompt_logprobs says.
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs
    _fill_params(req, gen, req.max_tokens, req.logprobs, prompt_logprobs, req.echo)
    gen.echo = req.echo
    gen.return_token_ids = bool(req.return_token_ids)
    return gen


def embedding_to_generate(prompt: str | list[int], pooling, priority: int = 0) -> generate_pb2.GenerateRequest:
    """One embedding input (checked by embeddings.inputs) as a prefill-only request that returns
    its pooled vector (pooling: a common_pb2.Pooling)."""
    gen = generate_pb2.GenerateRequest()
    if isinstance(prompt, str):
        gen.prompt = prompt
    else:
        for token in prompt:
            _check_uint32(token, "input")
        gen.prompt_token_ids.ids[:] = prompt
    if not -(2**31) <= priority < 2**31:
        raise bad_request("priority must be a 32-bit integer", "priority")
    gen.priority = priority
    gen.params.max_tokens = 0
    gen.params.pooling.CopyFrom(pooling)
    return gen


def chat_to_generate(req: ChatCompletionRequest) -> generate_pb2.GenerateRequest:
    """The tools and tool_choice are mapped by tools.apply_tools (it needs the server's parser)."""
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    gen = generate_pb2.GenerateRequest()
    fill_template_options(req, gen.chat)
    for i, message in enumerate(req.messages):
        if message.role not in _ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {message.role!r}",
                              "messages")
        proto = gen.chat.messages.add(role=message.role)
        message_content(message.content, f"messages[{i}]", proto)  # text, or parts with images
        history_fields(message, proto, f"messages[{i}]")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if req.top_logprobs < 0:  # (the upper bound is the server's --max-logprobs: completion_call)
            raise bad_request(f"top_logprobs must be an integer >= 0, got {req.top_logprobs}", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # max_completion_tokens replaced max_tokens in OpenAI's chat API; the newer one wins.
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    try:
        _fill_params(req, gen, max_tokens, logprobs, req.prompt_logprobs)
    except RequestError as exc:
        if exc.param == "max_tokens" and req.max_completion_tokens is not None:
            exc.param = "max_completion_tokens"
        raise
    gen.return_token_ids = bool(req.return_token_ids)
    return gen


def fill_template_options(req: ChatCompletionRequest, chat: generate_pb2.ChatMessages) -> None:
    """add_generation_prompt, continue_final_message, chat_template_kwargs and documents (a template
    variable, as vLLM passes it; checked by the tokenizer, which renders the template:
    model_files/chat_templates.py)."""
    if req.chat_template is not None:
        raise bad_request("chat_template per request is not supported: the server's template is set with "
                          "--chat-template", "chat_template")
    if req.add_generation_prompt and req.continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true "
                          "(set add_generation_prompt to false to continue the last message)", "continue_final_message")
    chat.add_generation_prompt = req.add_generation_prompt
    chat.continue_final_message = req.continue_final_message
    if req.chat_template_kwargs:
        chat.chat_template_kwargs = json.dumps(req.chat_template_kwargs)
    if req.documents is not None:
        if "documents" in (req.chat_template_kwargs or {}):
            raise bad_request("documents is set twice: as a field and in chat_template_kwargs", "documents")
        chat.documents = json.dumps(req.documents)


def include_usage(req: _SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def continuous_usage(req: _SamplingFields) -> bool:
    """vLLM's stream_options.continuous_usage_stats (taken with include_usage only, as vLLM does)."""
    return include_usage(req) and req.stream_options.continuous_usage_stats


def include_event_ids(req: _SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_event_ids)


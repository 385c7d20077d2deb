"""Rendering a chat through a model's template, with vLLM's controls: a template given by the
operator (--chat-template FILE or inline Jinja), add_generation_prompt, continue_final_message and
per-request chat_template_kwargs. Plain functions over an HF tokenizer (no torch): the tokenizer
service and the in-process engine's offline API both render through render_chat, so the same chat
gives the same tokens on every path.

A raw text prompt is encoded with the tokenizer's special tokens (text_token_ids). As vLLM does,
the chat is rendered to text first and that text is then encoded without special
tokens (the template writes the BOS itself where the model wants one).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# Keywords the renderer sets itself: a request's chat_template_kwargs may not override them.
RESERVED_KWARGS = frozenset({"conversation", "messages", "chat_template", "tokenize", "add_generation_prompt",
                             "continue_final_message", "return_dict", "tokenizer", "return_tensors"})


class ChatTemplateError(ValueError):
    """A chat that cannot be rendered (bad messages, bad options, the template raised)."""


def load_chat_template(value: str | Path | None) -> str | None:
    """--chat-template: a file's contents, or the value itself when it is no file and looks like
    Jinja (vLLM accepts both). None stays None (the model's own template)."""
    if value is None or value == "":
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--chat-template {value}: cannot read it ({exc})") from None
    if any(mark in str(value) for mark in ("{{", "{%")):
        return str(value)
    raise ValueError(f"--chat-template {value}: no such file (and not an inline Jinja template)")


# A template that loops over a message's content (`for part in message['content']`, `message.content`)
# takes content lists: vLLM's "openai" content format (a text message's content as [{"type": "text", ...}]).
_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+\s*(\[\s*['\"]content['\"]\s*\]|\.content\b)")


def takes_content_lists(template: str | None) -> bool:
    return isinstance(template, str) and _CONTENT_LOOP.search(template) is not None


def check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] must be an object with a string 'role'")
    return messages


def render_chat(tokenizer, messages: list[dict], *, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
    """The chat as the prompt text the model sees. Raises ChatTemplateError naming what was wrong."""
    check_messages(messages)
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be true "
                                "(continue the last message, or start a new assistant turn)")
    if continue_final_message and messages[-1].get("role") != "assistant":
        raise ChatTemplateError("continue_final_message needs the last message to be the assistant's, "
                                f"got role {messages[-1].get('role')!r}")
    if not isinstance(chat_template_kwargs or {}, dict):
        raise ChatTemplateError("chat_template_kwargs must be an object")
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_KWARGS & set(extra))
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)} (they are request fields "
                                "or set by the server)")
    if tools is not None:
        extra["tools"] = tools
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the model has no chat template (start the server with --chat-template FILE)")
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **extra)
    except Exception as exc:  # jinja2 errors, raise_exception() in the template
        raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(text, str):
        raise ChatTemplateError(f"the chat template rendered {type(text).__name__}, not text")
    return text


def text_token_ids(tokenizer, text: str) -> list[int]:
    """The token ids of a raw text prompt: encoded with the tokenizer's special tokens (Gemma's
    <bos>), as vLLM and transformers do. The tokenizer service, the offline engine and the cli's
    prompt lines all encode a text prompt here."""
    return list(tokenizer.encode(text, add_special_tokens=True))


def chat_token_ids(tokenizer, messages: list[dict], **options) -> tuple[list[int], str]:
    """(token ids, prompt text) of a chat: render_chat, then encode without special tokens."""
    text = render_chat(tokenizer, messages, **options)
    return list(tokenizer.encode(text, add_special_tokens=False)), text

"""OpenAI's response shapes: completion and chat.completion objects, their streaming chunks and
usage, built from the tokenizer service's GenerateResponse messages (logprobs' shapes: logprobs.py;
the timings object: timings.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.gateway.logprobs import CompletionLogprobs, chat_logprobs, vllm_prompt_logprobs
from pagedserve.gateway.reasoning import ReasoningSplitter, split
from pagedserve.gateway.tools import ToolOutput, finish_reason, message_fields, stream_deltas
from pagedserve.v1 import common_pb2, generate_pb2

def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class UsageTracker:
    """Token counts of one request: the prompt once, plus every sample's completion tokens."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.final: dict[int, int] = {}    # sample -> completion_tokens from its last message
        self.counted: dict[int, int] = {}  # sample -> token ids seen (when usage is missing)

    def add(self, msg: generate_pb2.GenerateResponse) -> None:
        if msg.HasField("usage"):
            self.prompt_tokens = msg.usage.prompt_tokens or self.prompt_tokens
            self.cached_tokens = max(self.cached_tokens, msg.usage.cached_tokens)
        if not msg.accepted:
            self.counted[msg.index] = self.counted.get(msg.index, 0) + len(msg.token_ids)
            if msg.finish_reason and msg.HasField("usage"):
                self.final[msg.index] = msg.usage.completion_tokens

    @property
    def completion_tokens(self) -> int:
        indices = set(self.final) | set(self.counted)
        return sum(self.final.get(i, self.counted.get(i, 0)) for i in indices)

    def as_dict(self) -> dict:
        return usage_dict(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A chat request's reasoning reading (gateway/reasoning.py), given when the server has a
    --reasoning-parser: messages carry "reasoning_content"; parser None (the request turned
    thinking off): it is null and the text is all content."""

    parser: str | None


# ---- whole responses ------------------------------------------------------------------------
@dataclass
class SampleOutput:
    text: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class Collector:
    """Accumulates a non-streamed generation, per sample. The prompt's logprobs come once per
    request (with sample 0's first message) and every choice shows them."""

    def __init__(self, n: int) -> None:
        self.samples = [SampleOutput() for _ in range(n)]
        self.usage = UsageTracker()
        self.prompt_text = ""
        self.embedding = b""  # an embedding request's vector (float32 LE), from its last message
        self.prompt_logprobs: list[common_pb2.TokenLogprob] = []
        self.prompt_token_ids: list[int] = []  # return_token_ids: from the accepted message

    def add(self, msg: generate_pb2.GenerateResponse) -> None:
        self.usage.add(msg)
        if msg.accepted:
            self.prompt_text = msg.prompt_text or self.prompt_text
            self.prompt_token_ids = list(msg.prompt_token_ids) or self.prompt_token_ids
            return
        while msg.index >= len(self.samples):
            self.samples.append(SampleOutput())
        sample = self.samples[msg.index]
        if msg.embedding:
            self.embedding = msg.embedding
        if msg.text:
            sample.text.append(msg.text)
        sample.logprobs.extend(msg.logprobs)
        sample.token_ids.extend(msg.token_ids)
        if msg.prompt_logprobs:
            self.prompt_logprobs = list(msg.prompt_logprobs)
        if msg.finish_reason:
            sample.finish_reason = msg.finish_reason

    def completion(self, request_id: str, model: str, created: int, logprobs: bool, echo: bool,
                   prompt_logprobs: bool = False, token_ids: bool = False) -> dict:
        """echo with logprobs: the logprobs cover the prompt, then the completion (text_offset from 0).
        prompt_logprobs (vLLM's field was sent): each choice carries "prompt_logprobs"; token_ids
        (vLLM's return_token_ids): each carries "prompt_token_ids" and its own "token_ids"."""
        choices = []
        for i, s in enumerate(self.samples):
            prefix = self.prompt_text if echo else ""
            echoed = self.prompt_logprobs if echo else ()
            choice = {
                "index": i, "text": prefix + "".join(s.text),
                "logprobs": CompletionLogprobs(0 if echoed else len(prefix)).build(s.logprobs, echoed)
                if logprobs else None,
                "finish_reason": s.finish_reason, "stop_reason": None}
            if prompt_logprobs:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_logprobs)
            if token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = self.prompt_token_ids, s.token_ids
            choices.append(choice)
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": self.usage.as_dict(), "system_fingerprint": None}

    def chat(self, request_id: str, model: str, created: int, logprobs: bool,
             tools: ToolOutput | None = None, reasoning: Reasoning | None = None, token_ids: bool = False) -> dict:
        """token_ids (vLLM's return_token_ids): "prompt_token_ids" beside the choices, each choice
        its "token_ids"."""
        choices = []
        for i, s in enumerate(self.samples):
            message, reason = {"role": "assistant", "content": "".join(s.text)}, s.finish_reason
            if reasoning is not None:  # the reasoning first; what follows it is the content
                thought, message["content"] = split(reasoning.parser, message["content"]) if reasoning.parser \
                    else (None, message["content"])
            if tools is not None:  # the content read for tool calls
                parsed = tools.parse(message["content"] or "")
                message.update(message_fields(parsed))
                reason = finish_reason(reason, bool(parsed.calls))
            if reasoning is not None:
                if reasoning.parser and not message["content"]:
                    message["content"] = None  # vLLM's: no text after the reasoning is null content
                message["reasoning_content"] = thought
            choices.append({"index": i, "message": message, "logprobs": chat_logprobs(s.logprobs) if logprobs else None,
                            "finish_reason": reason, "stop_reason": None})
            if token_ids:
                choices[-1]["token_ids"] = s.token_ids
        out = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
               "choices": choices, "usage": self.usage.as_dict(), "system_fingerprint": None}
        if token_ids:
            out["prompt_token_ids"] = self.prompt_token_ids
        return out


# ---- streaming chunks -----------------------------------------------------------------------
class ChunkBuilder:
    """Turns one request's GenerateResponse stream into OpenAI chunks (dicts, one or more per
    message). Chat: each sample's first chunk carries role "assistant"; completions: an echoed
    prompt comes first in each sample's text. The prompt's logprobs come once per request, with
    sample 0's first message, ahead of every other sample's first (the scheduler orders them so):
    kept here, each sample's first chunk shows them. token_ids (vLLM's return_token_ids): every
    chunk of a message carries its "token_ids" (a message with ids and no text still makes a
    chunk), and the prompt's ids come once per sample: a chat's role chunks carry
    "prompt_token_ids" beside the choices, a completion's first choice of each sample in it."""

    def __init__(self, chat: bool, request_id: str, model: str, created: int, n: int,
                 logprobs: bool, echo: bool = False, tools: ToolOutput | None = None,
                 prompt_logprobs: bool = False, reasoning: Reasoning | None = None,
                 token_ids: bool = False, chat_echo: str = "") -> None:
        self.chat, self.request_id, self.model, self.created = chat, request_id, model, created
        self.n, self.logprobs, self.echo, self.prompt_logprobs = n, logprobs, echo, prompt_logprobs
        self.tools, self.parsers, self.called = tools, {}, set()  # tool calls: a parser per sample
        # The reasoning: a splitter per sample, when the request is read with a reasoning parser.
        self.reasoning = reasoning.parser if chat and reasoning is not None else None
        self.splitters: dict[int, ReasoningSplitter] = {}
        # echo with logprobs: each sample's prompt text waits for its first message, which brings
        # the prompt's logprobs, and goes out in one chunk with them.
        self.held_prompt: dict[int, str] = {}
        self.prompt_entries: list[common_pb2.TokenLogprob] = []  # the request's prompt logprobs
        self.started: set[int] = set()  # samples whose first message has come
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.usage = UsageTracker()
        self.offsets: dict[int, CompletionLogprobs] = {}
        self.token_ids = token_ids
        self.chat_echo = chat_echo  # vLLM's chat echo: each sample's content starts with it
        self.prompt_ids: list[int] = []
        self.ids_pending: set[int] = set()  # completions: samples whose prompt ids are still to go out

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices}

    def _choice(self, index: int, text: str | None, logprobs: dict | None, finish_reason: str | None,
                role: bool = False) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}

    def add(self, msg: generate_pb2.GenerateResponse) -> list[dict]:
        if self.reasoning is None or msg.accepted:
            return self._add(msg)
        thought, content = self._split(msg.index, msg.text, bool(msg.finish_reason))
        view = generate_pb2.GenerateResponse()
        view.CopyFrom(msg)
        view.text = content
        chunks = self._add(view)
        if not thought:
            return chunks
        if not chunks:
            choice = {"index": msg.index, "delta": {"reasoning_content": thought}, "logprobs": None,
                      "finish_reason": None}
            self._with_ids(choice, msg)
            return [self._chunk([choice])]
        delta = chunks[0]["choices"][0]["delta"]
        rest = {k: v for k, v in delta.items() if not (k == "content" and v == "")}
        delta.clear()
        delta.update({"reasoning_content": thought, **rest})
        return chunks

    def _split(self, index: int, text: str, final: bool) -> tuple[str, str]:
        splitter = self.splitters.setdefault(index, ReasoningSplitter(self.reasoning))
        thought, content = splitter.feed(text) if text else ("", "")
        if final:
            more = splitter.finish()
            thought, content = thought + more[0], content + more[1]
        return thought, content

    def _add(self, msg: generate_pb2.GenerateResponse) -> list[dict]:
        self.usage.add(msg)
        if msg.accepted:
            return self._accepted(msg)
        if msg.prompt_logprobs:
            self.prompt_entries = list(msg.prompt_logprobs)
        first = msg.index not in self.started
        self.started.add(msg.index)
        prompt_entries = self.prompt_entries if first else ()
        held = self.held_prompt.pop(msg.index, None)
        echoed = prompt_entries if held is not None else ()
        if held is None and not msg.text and not msg.finish_reason and not (self.logprobs and msg.logprobs) \
                and not (self.prompt_logprobs and prompt_entries) and not (self.token_ids and msg.token_ids):
            return []
        logprobs = None
        if self.logprobs and (msg.logprobs or echoed):
            if self.chat:
                logprobs = chat_logprobs(msg.logprobs)
            else:
                logprobs = self.offsets.setdefault(msg.index, CompletionLogprobs()).build(msg.logprobs, echoed)
        if self.chat and self.tools is not None:
            return self._tool_chunks(msg, logprobs)
        text = msg.text if (msg.text or not self.chat or not msg.finish_reason) else None
        if held is not None:
            text = held + (text or "")
        choice = self._choice(msg.index, text, logprobs, msg.finish_reason or None)
        if self.prompt_logprobs and prompt_entries:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_entries)
        self._with_ids(choice, msg)
        return [self._chunk([choice])]

    def _accepted(self, msg: generate_pb2.GenerateResponse) -> list[dict]:
        self.prompt_ids = list(msg.prompt_token_ids)
        if self.chat:
            chunks = [self._chunk([self._choice(i, "", None, None, role=True)]) for i in range(self.n)]
            if self.token_ids:
                for chunk in chunks:
                    chunk["prompt_token_ids"] = self.prompt_ids
            if self.chat_echo:
                chunks += [self._chunk([self._choice(i, self.chat_echo, None, None)]) for i in range(self.n)]
            return chunks
        if self.token_ids:
            self.ids_pending = set(range(self.n))
        prompt = msg.prompt_text if self.echo else ""
        for i in range(self.n):
            self.offsets[i] = CompletionLogprobs(0 if prompt and self.logprobs else len(prompt))
        if prompt and self.logprobs:
            self.held_prompt = dict.fromkeys(range(self.n), prompt)
            return []
        if not prompt:
            return []
        choices = [self._choice(i, prompt, None, None) for i in range(self.n)]
        for choice in choices:
            self._with_ids(choice, None)
        return [self._chunk([choice]) for choice in choices]

    def _with_ids(self, choice: dict, msg: generate_pb2.GenerateResponse | None) -> None:
        """return_token_ids: the message's ids on its choice, and a completion sample's prompt ids
        on its first choice."""
        if not self.token_ids:
            return
        if choice["index"] in self.ids_pending:
            self.ids_pending.discard(choice["index"])
            choice["prompt_token_ids"] = self.prompt_ids
        choice["token_ids"] = list(msg.token_ids) if msg is not None else []

    def _parser(self, index: int):
        if index not in self.parsers:
            self.parsers[index] = self.tools.new()
        return self.parsers[index]

    def skip_text(self, index: int, text: str) -> None:
        """A resumed stream: text the client already had, read by the parsers to catch up."""
        if self.reasoning is not None and text:
            text = self._split(index, text, False)[1]
        if self.chat and self.tools is not None and text:
            if any(e.name is not None for e in self._parser(index).feed(text)):
                self.called.add(index)

    def _tool_chunks(self, msg: generate_pb2.GenerateResponse, logprobs: dict | None) -> list[dict]:
        parser = self._parser(msg.index)
        events = parser.feed(msg.text) if msg.text else []
        if msg.finish_reason:
            events += parser.finish()
        if any(e.name is not None for e in events):
            self.called.add(msg.index)
        reason = finish_reason(msg.finish_reason or None, msg.index in self.called)
        shown_ids = self.token_ids and bool(msg.token_ids)
        deltas = stream_deltas(events) or ([{}] if reason or logprobs or shown_ids else [])
        chunks = [self._chunk([{"index": msg.index, "delta": delta, "logprobs": logprobs if j == 0 else None,
                                "finish_reason": reason if j == len(deltas) - 1 else None}])
                  for j, delta in enumerate(deltas)]
        if self.token_ids:  # the message's ids on its first chunk
            for j, chunk in enumerate(chunks):
                chunk["choices"][0]["token_ids"] = list(msg.token_ids) if j == 0 else []
        return chunks

    def with_usage(self, chunks: list[dict]) -> list[dict]:
        """vLLM's continuous usage: each chunk with a choice carries that choice's usage so far (its
        completion tokens, the prompt's), in place."""
        for chunk in chunks:
            if chunk["choices"]:
                index = chunk["choices"][0]["index"]
                tracked = self.usage
                done = tracked.final.get(index, tracked.counted.get(index, 0))
                chunk["usage"] = usage_dict(tracked.prompt_tokens, done, tracked.cached_tokens)
        return chunks

    def usage_chunk(self) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = self.usage.as_dict()
        return chunk

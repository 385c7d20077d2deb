"""One offline request's text: the engine's per-step token deltas of each sample turned into
vLLM's cumulative RequestOutput (incremental detokenization and stop strings by the tokenizer
service's own SampleText, so text and stop handling match the servers').

Used by LLM and AsyncLLM on the thread that steps the engine; not thread-safe. Invariant: a
sample's token_ids end at the token that completed its stop string, and after its finish
nothing more is appended (the engine may run an unforked sample a step longer; see apply).
"""

from __future__ import annotations

import dataclasses

from pagedserve.common import bad_words
from pagedserve.common.offline_types import CompletionOutput, RequestOutput, SamplingParams
from pagedserve.tokenizer.detokenizer import SampleText


class TextRequest:
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "samples", "texts", "num_cached_tokens",
                 "prompt_logprobs")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        words = getattr(params, "bad_words", None)
        if words:  # vLLM's bad_words, as the tokenizer service reads them
            encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
            params = dataclasses.replace(params, bad_words_token_ids=bad_words.token_sequences(words, encode))
        self.params = params
        stop = list(getattr(params, "stop", None) or [])
        skip = getattr(params, "skip_special_tokens", True)
        include = getattr(params, "include_stop_str_in_output", False)
        self.samples = [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None,
                                         cumulative_logprob=0.0 if params.logprobs is not None else None)
                        for i in range(params.n)]
        self.texts = [SampleText(tokenizer, prompt_token_ids, skip, stop, include) for _ in range(params.n)]
        self.num_cached_tokens = 0
        self.prompt_logprobs = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def apply(self, out) -> bool:
        """Take one engine step's output (pagedserve.engine.RequestOutput) for one sample. True
        when a stop string ended the sample here, while the engine still runs it (the caller
        aborts it there)."""
        sample = self.samples[out.sample_index]
        if sample.finish_reason is not None:
            return False
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None, *out.prompt_logprobs]
        ids = [t.token_id for t in out.new_tokens]
        text, used, stopped = self.texts[out.sample_index].push(ids, final=out.finished)
        sample.text += text
        sample.token_ids.extend(ids[:used])
        if sample.logprobs is not None:
            for token in out.new_tokens[:used]:
                sample.logprobs.append(token)
                sample.cumulative_logprob += token.logprob or 0.0
        if stopped:
            sample.finish_reason = "stop"
            sample.stop_reason = self.texts[out.sample_index].matcher.stop_str
            return not out.finished
        if out.finished:
            sample.finish_reason = out.finish_reason or "stop"
        return False

    def abort(self) -> None:
        for s in self.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"

    def output(self) -> RequestOutput:
        """A snapshot (copies: an AsyncLLM consumer may hold it while the engine goes on)."""
        outputs = [CompletionOutput(s.index, s.text, list(s.token_ids), s.cumulative_logprob,
                                    None if s.logprobs is None else list(s.logprobs), s.finish_reason, s.stop_reason)
                   for s in self.samples]
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), outputs, self.finished,
                             self.num_cached_tokens,
                             None if self.prompt_logprobs is None else list(self.prompt_logprobs))

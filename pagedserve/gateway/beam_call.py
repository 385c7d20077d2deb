"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: the search of
common/beam_search.py driven through the tokenizer service, as vLLM's server drives it through its
engine. The first step sends the request as the client wrote it (its prompt, or its chat through
the template) and learns the prompt's token ids; every later step sends each live beam's tokens as
a one-token request asking for 2 x n logprobs, all of a step's beams at once (the scheduler's
prefix cache holds the beams' common blocks, within the caller's cache scope). The answer comes
when the search ends: n choices, the best beam first (its text the output's, EOS left out), whole,
or streamed as one chunk a choice (vLLM streams a beam search the same way). Fields the search does
not read (logprobs, stop strings, tools, structured outputs, echo) are refused by name.

Threads: the serving event loop. The call (completion_call.CompletionCall) holds the request's
admission and tokens in flight from the first step to the answer (the gateway's drain waits for it;
past --shutdown-timeout it takes no further step and answers 503); each step's requests are internal
(their ids: the call's, then the step and the beam).
"""

from __future__ import annotations

import asyncio

import grpc
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.common.beam_search import BeamSearch, BeamSearchParams, beam_width_problem
from pagedserve.gateway.background import watch_disconnect
from pagedserve.gateway.backend import rpc_error
from pagedserve.gateway.generation import forward_as
from pagedserve.gateway.protocol import RequestError
from pagedserve.gateway.responses import usage_dict
from pagedserve.gateway.sse import DONE, SSE_HEADERS, sse_event
from pagedserve.v1 import generate_pb2

# Request fields a beam search does not read, with what each means off: sent otherwise, a 400.
REFUSED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (False,), "stop": (None, [], ""),
           "stop_token_ids": (None, []), "tools": (None, []), "response_format": (None,),
           "structured_outputs": (None,), "structural_tag": (None,), "guided_json": (None,),
           "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
           "prompt_logprobs": (None,), "min_tokens": (0,),
           "logit_bias": (None, {}), "bad_words": (None, []), "allowed_token_ids": (None,), "seed": (None,),
           "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
           "repetition_penalty": (None, 1, 1.0)}


def check_beam_request(body, max_logprobs: int) -> BeamSearchParams | None:
    """The search's parameters when the body asks for one (n beams), else None; 400 naming a field
    the search would not honour, or n past what the server's --max-logprobs (max_logprobs) allows."""
    if not getattr(body, "use_beam_search", False):
        return None
    for name, off in REFUSED.items():
        value = getattr(body, name, None)
        if not any(value is v or (type(value) is type(v) and value == v) for v in off):
            raise RequestError(400, f"{name} is not supported with use_beam_search", name)
    problem = beam_width_problem(body.n, max_logprobs)
    if problem:
        raise RequestError(400, problem, "n")
    try:
        return BeamSearchParams(beam_width=body.n, max_tokens=1 << 30, ignore_eos=body.ignore_eos,
                                temperature=body.temperature or 0.0, length_penalty=body.length_penalty)
    except ValueError as exc:
        param = "n" if "beam_width" in str(exc) else "temperature"
        raise RequestError(400, str(exc).replace("beam_width", "n (the beam width)"), param) from None


class BeamCall:
    """One beam search for a CompletionCall (`call`): its owner, ids, model, admission and end."""

    def __init__(self, call, gen: generate_pb2.GenerateRequest, params: BeamSearchParams, info) -> None:
        self.call, self.gen, self.params, self.info = call, gen, params, info
        self.backend = call.backend
        step = generate_pb2.GenerateRequest()
        step.params.CopyFrom(gen.params)
        step.params.n, step.params.max_tokens, step.params.logprobs = 1, 1, 2 * params.beam_width
        step.params.ignore_eos = True
        step.params.temperature = params.temperature
        step.model, step.priority = gen.model, gen.priority
        self.step = step
        self.count = 0

    async def _one(self, request: generate_pb2.GenerateRequest, timeout: float | None):
        """(prompt token ids, the first token's candidates [(id, logprob)...]) of one step request."""
        call = self.call
        self.count += 1
        forward_as(request, call.caller, f"{call.client_id}-beam{self.count}", call.received,
                   self.backend.prefix_cache_scope, self.backend.loras)
        prompt, candidates = list(request.prompt_token_ids.ids), None
        try:
            async for msg in self.backend.tokenizer.Generate(request, timeout=timeout):
                if msg.accepted:
                    prompt = list(msg.prompt_token_ids) or prompt
                elif msg.logprobs and candidates is None:
                    first = msg.logprobs[0]
                    candidates = [(first.token_id, first.logprob)] + [(t.token_id, t.logprob) for t in first.top]
        except grpc.RpcError as exc:
            raise rpc_error(exc) from exc
        if candidates is None:
            raise RequestError(500, "a beam search step ended without its token's logprobs", type="server_error")
        return prompt, candidates

    async def search(self, timeout: float | None) -> tuple[list, int, int | None]:
        """(the best beams, the prompt's length, the EOS id)."""
        first = generate_pb2.GenerateRequest()
        first.CopyFrom(self.step)
        which = self.gen.WhichOneof("input")
        if which == "prompt":
            first.prompt = self.gen.prompt
        else:
            getattr(first, which).CopyFrom(getattr(self.gen, which))
        first.return_token_ids = True
        prompt, candidates = await self._one(first, timeout)
        backend, call = self.backend, self.call
        budget = self.gen.params.max_tokens if self.gen.params.HasField("max_tokens") else \
            self.info.max_model_len - len(prompt)
        params = BeamSearchParams(self.params.beam_width, max(1, min(budget, self.info.max_model_len - len(prompt))),
                                  self.params.ignore_eos, self.params.temperature, self.params.length_penalty)
        call.prompt_tokens = len(prompt)
        call.reserved = backend.admission.reserve(len(prompt), params.beam_width, params.max_tokens,
                                                  self.info.max_model_len)
        eos = self.info.eos_token_id if self.info.HasField("eos_token_id") else None
        search = BeamSearch(prompt, params, eos)
        search.step([candidates])
        while not search.done:
            if call.shutdown:  # the drain gave up waiting (--shutdown-timeout): no more steps
                raise RequestError(503, "the server is shutting down: the beam search was stopped after "
                                   "--shutdown-timeout", type="service_unavailable", code="server_shutdown")
            requests = []
            for beam in search.live:
                request = generate_pb2.GenerateRequest()
                request.CopyFrom(self.step)
                request.prompt_token_ids.ids.extend(beam.tokens)
                requests.append(request)
            results = await asyncio.gather(*(self._one(r, timeout) for r in requests))
            search.step([candidates for _, candidates in results])
        return search.best(), len(prompt), eos

    async def texts(self, beams, prompt_len: int, eos: int | None) -> list[str]:
        skip = self.gen.skip_special_tokens
        out = []
        for beam in beams:
            tokens = beam.tokens[prompt_len:]
            if beam.finish_reason == "stop" and tokens and tokens[-1] == eos:
                tokens = tokens[:-1]  # vLLM's: the EOS that ended a beam is not in its text
            reply = await self.backend.tokenizer.Detokenize(
                generate_pb2.DetokenizeRequest(token_ids=tokens, skip_special_tokens=skip), timeout=30.0)
            out.append(reply.text)
        return out


async def run_beam_search(call, gen: generate_pb2.GenerateRequest, params: BeamSearchParams, info,
                          timeout: float | None) -> Response:
    """The answer of a CompletionCall that asked for a beam search (after its admission checks)."""
    beam = BeamCall(call, gen, params, info)
    call.backend.inflight.add(call)
    search = asyncio.ensure_future(beam.search(timeout))
    # a client that leaves ends the search (its step requests are cancelled with it)
    watcher = asyncio.create_task(watch_disconnect(call.request.receive, search.cancel))
    try:
        best, prompt_len, eos = await asyncio.wait_for(search, timeout)  # the request's timeout: the whole search
        texts = await beam.texts(best, prompt_len, eos)
    except asyncio.TimeoutError:
        raise RequestError(504, "the request's timeout passed: the beam search was stopped", "timeout", "timeout",
                           "timeout") from None
    except asyncio.CancelledError:
        if search.cancelled() and not watcher.done():
            raise
        raise RequestError(499, "client closed the request", type="client_closed") from None
    finally:
        watcher.cancel()
        call.finished = True
        call.end()
    usage = usage_dict(prompt_len, sum(len(b.tokens) - prompt_len for b in best))
    choices = []
    for i, (b, text) in enumerate(zip(best, texts)):
        if call.chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                            "finish_reason": b.finish_reason, "stop_reason": None})
        else:
            choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": b.finish_reason,
                            "stop_reason": None})
    kind = "chat.completion" if call.chat else "text_completion"
    body = {"id": call.client_id, "object": kind, "created": call.created, "model": call.model, "choices": choices,
            "usage": usage, "system_fingerprint": None}
    headers = {"x-request-id": call.client_id}
    if not call.stream:
        return JSONResponse(body, headers=headers)
    return _as_stream(body, call.usage, headers)


def _as_stream(body: dict, with_usage: bool, headers: dict) -> Response:
    chat = body["object"] == "chat.completion"
    head = {k: body[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    events = []
    for c in body["choices"]:
        if chat:
            events.append({**head, "choices": [{"index": c["index"], "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            events.append({**head, "choices": [{"index": c["index"], "delta": {"content": c["message"]["content"]},
                                                "logprobs": None, "finish_reason": c["finish_reason"]}]})
        else:
            events.append({**head, "choices": [{"index": c["index"], "text": c["text"], "logprobs": None,
                                                "finish_reason": c["finish_reason"]}]})
    if with_usage:
        events.append({**head, "choices": [], "usage": body["usage"]})

    async def stream():
        for event in events:
            yield sse_event(event)
        yield DONE
    return StreamingResponse(stream(), media_type="text/event-stream", headers={**headers, **SSE_HEADERS})

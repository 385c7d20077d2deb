"""/v1/completions with a list of prompts (strings or token-id lists), as OpenAI and vLLM answer
it: one choice per prompt and sample, prompt i's sample j at index i * n + j, one response (one
stream) with the usage summed.

Each prompt is its own CompletionCall (completion_call.py) in `raw` mode: its own request at the
scheduler, admission and tokens-in-flight reservation, metrics and abort on disconnect; this
module only starts them together and merges what they answer. Every prompt is validated before
any is sent, so a bad parameter is one 400 and nothing runs; a prompt refused downstream (too
long for the context, say) cancels the others before the headers. The response's id is the
first prompt's request id; `x-request-id` lists every prompt's, in order.

A batch is as many requests as it has prompts, against the key's limits, before any prompt is
sent: its prompts x n sequences at most MAX_SEQUENCES (400), one request per prompt off the key's
rate bucket (429), and its output budget (prompts x n x max_tokens) within --max-tokens-in-flight
(429); each prompt's call then reserves its own tokens in flight as any request does.

Threads: the serving event loop. Invariants: the merged stream ends (by its end, an error, or
the client leaving) only after every prompt's call has been closed, so no request is left
running; the merged stream sends one [DONE], after every prompt's end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve.gateway.backend import Backend, as_request_error
from pagedserve.gateway.completion_call import CompletionCall
from pagedserve.gateway.sse import SSE_HEADERS
from pagedserve.gateway.protocol import (CompletionRequest, RequestError, bad_request, completion_to_generate)
from pagedserve.gateway.responses import usage_dict
from pagedserve.gateway.sse import DONE, CancellingStream, sse_event

# More prompts than this in one request is refused: each is a request of its own downstream.
MAX_PROMPTS = 256
# More sequences (prompts x n) than this in one request is refused: each is a sequence downstream.
MAX_SEQUENCES = 256


def is_batched(body: CompletionRequest) -> bool:
    prompt = body.prompt
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))


def split(body: CompletionRequest) -> list[CompletionRequest]:
    """One body per prompt, each validated as a single request would be (400 before anything runs)."""
    prompts = body.prompt
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"prompt has {len(prompts)} prompts; at most {MAX_PROMPTS} in one request", "prompt")
    if len(prompts) * body.n > MAX_SEQUENCES:
        raise bad_request(f"{len(prompts)} prompts x n={body.n} is {len(prompts) * body.n} sequences; at most "
                          f"{MAX_SEQUENCES} in one request", "n")
    parts = [body.model_copy(update={"prompt": p}) for p in prompts]
    for i, part in enumerate(parts):
        try:
            completion_to_generate(part)
        except RequestError as exc:
            if exc.param == "prompt":
                exc.message = f"prompt[{i}]: {exc.message}"
            raise
    return parts


async def run_batched(backend: Backend, request: Request, body: CompletionRequest) -> Response:
    """POST /v1/completions with a list of prompts; any failure before the headers is an HTTP error."""
    try:
        return await _run(backend, request, body)
    except RequestError:
        raise
    except Exception as exc:
        raise as_request_error(exc) from exc


async def _run(backend: Backend, request: Request, body: CompletionRequest) -> Response:
    if request.headers.get("idempotency-key"):
        raise bad_request("Idempotency-Key is not supported with a list of prompts", "prompt")
    parts = split(body)
    admission = backend.admission
    admission.check_n(body.n)
    # The gate took one request off the key's rate bucket; the other prompts are requests too.
    await admission.admit_more(request.headers.get("authorization"),
                               request.client.host if request.client else None, len(parts) - 1)
    if body.max_tokens:
        admission.check_tokens_fit(len(parts) * body.n * body.max_tokens)
    calls = [CompletionCall(backend, request, False, part) for part in parts]
    for call in calls:
        call.raw = True
    answers = await start_all(calls)
    headers = {"x-request-id": ",".join(c.client_id for c in calls)}
    if body.stream:
        return CancellingStream(_merged_stream(calls, answers, body.n), lambda: _close_all(calls),
                                {**headers, **SSE_HEADERS})
    return JSONResponse(_merged_body(calls, answers, body.n), headers=headers)


async def start_all(calls: list[CompletionCall]) -> list:
    """Every call's answer (its raw stream, or its body); the first failure cancels the rest and
    is raised (an HTTP error: no headers are gone yet)."""
    tasks = [asyncio.ensure_future(call.start()) for call in calls]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # this handler was cancelled: the client left
        await _cancel(tasks, calls)
        raise
    failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
    if failed is None:
        return [t.result() for t in tasks]
    await _cancel(tasks, calls)
    raise failed.exception()


async def _cancel(tasks: list[asyncio.Future], calls: list[CompletionCall]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    _close_all(calls)


def _close_all(calls: list[CompletionCall]) -> None:
    for call in calls:
        if call.call is not None:
            call._closed()  # a call not run to its end aborts its request there


def _merged_body(calls: list[CompletionCall], bodies: list[dict], n: int) -> dict:
    out = dict(bodies[0])
    out["choices"] = [{**choice, "index": i * n + choice["index"]}
                      for i, body in enumerate(bodies) for choice in body["choices"]]
    out["usage"] = _summed_usage([b.get("usage") for b in bodies])
    out.pop("timings", None)  # per request; the merged answer has no single timeline
    return out


def _summed_usage(usages: list[dict | None]) -> dict:
    usages = [u for u in usages if u]
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    return usage_dict(sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages), cached)


async def _merged_stream(calls: list[CompletionCall], streams: list[AsyncIterator], n: int) -> AsyncIterator[str]:
    """The prompts' chunks as they come, re-indexed under the first prompt's id; their usage
    chunks (stream_options.include_usage) summed into one at the end."""
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        finally:
            await queue.put((i, ended))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    first_id, usages, running = calls[0].client_id, [], len(streams)
    try:
        while running:
            i, item = await queue.get()
            if item is ended:
                running -= 1
                continue
            if item is DONE or isinstance(item, str):
                continue
            if "error" in item:  # in-band error of one prompt: the batch ends with it
                yield sse_event(item)
                break
            if not item.get("choices") and item.get("usage"):
                usages.append(item["usage"])
                continue
            item["id"] = first_id
            for choice in item.get("choices", []):
                choice["index"] = i * n + choice["index"]
            yield sse_event(item)
        else:
            if usages:
                yield sse_event({"id": first_id, "object": "text_completion", "created": calls[0].created,
                                 "model": calls[0].model, "choices": [], "usage": _summed_usage(usages)})
        yield DONE
    finally:
        for p in pumps:
            p.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for s in streams:
            await s.aclose()
        _close_all(calls)

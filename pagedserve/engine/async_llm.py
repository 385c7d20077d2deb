"""AsyncLLM: the in-process engine behind an asyncio API, for embedding generation in an
application without the services (vLLM's `AsyncLLM`):

    engine = AsyncLLM(model=..., **engine_args)
    async for out in engine.generate("prompt", SamplingParams(...), request_id="r1"):
        print(out.outputs[0].text)   # cumulative: all the text so far

Threads: one engine thread owns the engine (steps, adds, aborts); the event loops that call
generate() only put commands on its queue and read their request's asyncio queue, which the
engine thread fills with call_soon_threadsafe. Each request yields one cumulative RequestOutput
per engine step that gave it tokens, the last with finished=True. Leaving the `async for` early
(break, cancellation) aborts the request. An engine error ends every running request with it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.offline_types import RequestOutput
from pagedserve.engine.llm import as_params, encode_chat, encode_with_images, load_engine
from pagedserve.engine.text_requests import TextRequest
from pagedserve.model_files import image_processing

_DONE = object()


@dataclass(slots=True)
class _Sink:
    """Where a request's outputs go: its caller's loop and queue."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request: TextRequest
    images: list = field(default_factory=list)  # its ImageInputs (a model that takes images)

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass


class AsyncLLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine, self.tokenizer, self.chat_template = load_engine(model, engine_args)
        self.image_config = image_processing.image_config(  # None: a text model
            self.engine.model_path, self.tokenizer, self.engine.config.mm_processor_kwargs)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._ids: set[str] = set()  # request ids in use (callers' side, under _lock)
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="async-llm-engine", daemon=True)
        self._thread.start()

    def get_tokenizer(self):
        return self.tokenizer

    # ---- the callers' side -------------------------------------------------------------------
    async def generate(self, prompt, sampling_params=None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs of one prompt (a string, {"prompt": str} or
        {"prompt_token_ids": [...]}, with vLLM's "multi_modal_data" images too), the last one finished."""
        text, ids, images = encode_with_images(self.tokenizer, self.image_config, prompt, "prompt")
        async for out in self._stream(text, ids, as_params(sampling_params), request_id, images):
            yield out

    async def chat(self, messages: list[dict], sampling_params=None, request_id: str | None = None,
                   **template_options: Any) -> AsyncIterator[RequestOutput]:
        """As generate, on a chat rendered by the chat template (options as LLM.chat's)."""
        template_options.setdefault("chat_template", self.chat_template)
        ids, text, images = encode_chat(self.tokenizer, self.image_config, messages, **template_options)
        async for out in self._stream(text, ids, as_params(sampling_params), request_id, images):
            yield out

    async def _stream(self, text, ids, params, request_id, images=()) -> AsyncIterator[RequestOutput]:
        if self._closed:
            raise RuntimeError("the AsyncLLM is shut down")
        if not ids:
            raise ValueError("the prompt is empty")
        engine = self.engine
        engine.scheduler.check_prompt(len(ids))  # reads the config only: safe off the engine thread
        vocab = engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"a prompt token id is outside the vocabulary [0, {vocab})")
        with self._lock:
            if request_id is None:
                request_id = f"async-{uuid.uuid4().hex}"
            if request_id in self._ids:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._ids.add(request_id)
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue(), TextRequest(request_id, text, ids, params,
                                                                               self.tokenizer), list(images))
        self._commands.put(("add", request_id, sink))
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(("abort", request_id, None))
            with self._lock:
                self._ids.discard(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its generator ends (its last output has finish_reason "abort")."""
        self._commands.put(("abort", request_id, None))

    def shutdown(self) -> None:
        """Stop the engine thread (running requests end with an error) and the engine."""
        if self._closed:
            return
        self._closed = True
        self._commands.put(("stop", None, None))
        self._thread.join()
        self.engine.close()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc) -> None:
        self.shutdown()

    # ---- the engine thread -------------------------------------------------------------------
    def _command(self, kind: str, request_id: str | None, sink: _Sink | None) -> bool:
        engine = self.engine
        if kind == "stop":
            for s in self._sinks.values():
                s.put(RuntimeError("the AsyncLLM was shut down"))
            self._sinks.clear()
            return False
        if kind == "add":
            try:
                engine.add_request(request_id, sink.request.prompt_token_ids, sink.request.params,
                                   images=sink.images)
            except Exception as exc:
                sink.put(exc)
                return True
            self._sinks[request_id] = sink
        elif kind == "abort":
            sink = self._sinks.pop(request_id, None)
            engine.abort(request_id)
            if sink is not None:
                sink.request.abort()
                sink.put(sink.request.output())
        return True

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug here: fail every waiting caller rather than hang them
            self._closed = True
            for sink in self._sinks.values():
                sink.put(RuntimeError(f"the AsyncLLM engine thread failed: {type(exc).__name__}: {exc}"))
            self._sinks.clear()
            raise

    def _loop(self) -> None:
        engine = self.engine
        while True:
            # Block for work when idle; otherwise take what came in and step.
            commands = [] if engine.has_unfinished() else [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            if not all(self._command(*c) for c in commands):
                return
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                for rid, sink in self._sinks.items():
                    engine.abort(rid)
                    sink.put(exc)
                self._sinks.clear()
                continue
            touched: dict[str, _Sink] = {}
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:  # aborted meanwhile
                    continue
                req = sink.request
                if req.apply(out):  # a stop string: the engine stops that sample (or all, n == 1)
                    engine.abort(out.request_id, out.sample_index if req.params.n > 1 else None)
                touched[out.request_id] = sink
            for rid, sink in touched.items():
                sink.put(sink.request.output())
                if sink.request.finished:
                    del self._sinks[rid]
                    engine.abort(rid)  # a stopped sample the engine could not abort alone

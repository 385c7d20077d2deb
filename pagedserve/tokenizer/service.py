"""The tokenizer service as a plain class: chat template and tokenization on the way in (on one
worker thread: HF tokenizers are not safe to call from several threads, and a long prompt must not
stall the event loop), model info, and the request streams (request_stream.py) that turn the
scheduler's token ids into text. Prompt and output text are never logged.

Threads: the event loop of the process (every method but the tokenization work) and the one
"tokenize" thread.

Images (a chat's ChatMessage.parts, for a model whose folder names an image token:
model_files/image_processing.py): decoded, resized and cropped on the tokenize thread too; each
image token the template wrote is expanded to the image's placeholders, and the ScheduleRequest
carries the prompt so expanded (its usage counts it) and the images over it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from pagedserve.common import bad_words
from pagedserve.common.grpc_util import StatusError, internal_channel
from pagedserve.common.multimodal import ImageInput, image_to_proto
from pagedserve.common.request_checks import other_model
from pagedserve.common.sampling_defaults import apply_defaults
from pagedserve.common.sampling_params import prompt_logprobs_problem
from pagedserve.model_files.chat_templates import ChatTemplateError, load_chat_template, render_chat, \
    takes_content_lists, text_token_ids
from pagedserve.model_files.image_processing import AnyImageConfig, expand_placeholders, process_image
from pagedserve.tokenizer import tokenization
from pagedserve.tokenizer.chat_render import template_kwargs, template_messages, template_tools
from pagedserve.tokenizer.replica_router import Charge, ReplicaRouter, Target
from pagedserve.tokenizer.request_stream import RequestStream
from pagedserve.tokenizer.scheduler_link import SchedulerLink
from pagedserve.v1 import common_pb2, generate_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("pagedserve.tokenizer")

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MODEL_INFO_TIMEOUT_S = 2.0


def default_served_name(model: str | None, folder: Path) -> str:
    if model and model.endswith(".gguf"):
        return Path(model).stem  # the prepared folder's name carries a cache digest
    if model and not Path(model).expanduser().exists():
        return model  # a hub id (its folder is a snapshot hash) or a prepared model's name
    return folder.name


def load_tokenizer(model: str | None, tokenizer_folder: str | None = None, revision: str | None = None):
    """(HF tokenizer, default served name, the model's vocab_size or None, the model's folder) for a folder
    or .gguf; tokenizer_folder (--tokenizer): where the tokenizer files are, if not with the model."""
    from pagedserve.model_files.default_model import resolve_model
    from pagedserve.model_files.tokenizer_files import load_tokenizer as load_folder_tokenizer
    folder = resolve_model(model, revision)
    tokenizer = load_folder_tokenizer(Path(tokenizer_folder).expanduser() if tokenizer_folder else folder)
    try:
        vocab_size = json.loads((folder / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        vocab_size = None
    return tokenizer, default_served_name(model, folder), vocab_size, folder


class TokenizerService:
    """Tokenization, model info and request streams; no gRPC server objects (see server.py)."""

    def __init__(self, tokenizer, served_model_name: str | list[str], scheduler_addr: str,
                 scheduler_retry_timeout: float = 120.0, vocab_size: int | None = None,
                 chat_template: str | None = None, router: ReplicaRouter | None = None,
                 local_links: bool = True, sampling_defaults: dict | None = None,
                 images: AnyImageConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.images = images  # the model's image front end; None: it takes no images
        # The model's sampling defaults (common/sampling_defaults.py): a request's unset fields take them.
        self.sampling_defaults = dict(sampling_defaults or {})
        self.chat_template = load_chat_template(chat_template)  # None: the model's own
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        # vLLM's "openai" content format: text content as [{"type": "text", ...}] too (image models only)
        self.list_content = images is not None and takes_content_lists(template)
        # --served-model-name: the first names the model in answers, the others are accepted too
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
        self.served_model_name, self.served_aliases = names[0], [n for n in dict.fromkeys(names[1:]) if n != names[0]]
        self.scheduler_addr = scheduler_addr
        self.retry_timeout_s = scheduler_retry_timeout
        # The model may have more embedding rows than the tokenizer has tokens.
        self.vocab_limit = max(len(tokenizer), vocab_size or 0)
        self.channel = internal_channel(scheduler_addr, aio=True)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.channel)
        # One thread: long prompts do not stall other streams, and HF tokenizers are not safe to
        # encode from several threads at once.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._token_text: dict[int, str] = {}
        self._background: set[asyncio.Task] = set()
        # One stream for all requests (opened on first use); local_links: over the scheduler's local
        # socket when it is on this host (--service-transport auto).
        self.link = SchedulerLink(self.scheduler, local_links)
        # Engine replicas (docs/scale-out.md): a router over the registered schedulers, one link
        # each; without one (or while none is registered) every request goes to scheduler_addr.
        self.router = router
        self.single = Target("", scheduler_addr, self.link, self.scheduler)

    async def route(self, schedule: scheduler_pb2.ScheduleRequest) -> tuple[Target, Charge | None]:
        """The scheduler this request (or re-attach) goes to, and its charge on that replica's
        in-flight tokens (None without replicas)."""
        if self.router is not None:
            picked = await self.router.pick(schedule)
            if picked is not None:
                return picked[0], self.router.charge(picked[0], schedule, picked[1])
        return self.single, None

    def any_scheduler(self):
        """A scheduler stub for questions every replica answers alike (model info)."""
        if self.router is not None and self.router.replicas:
            return self.router.target(min(self.router.replicas)).stub
        return self.scheduler

    async def close(self) -> None:
        if self.router is not None:
            await self.router.close()
        await self.link.close()
        await self.channel.close()
        self._executor.shutdown(wait=False)

    # -- tokenization -------------------------------------------------------------------------

    def _chat(self, chat: generate_pb2.ChatMessages, tokenize: bool):
        """The chat's prompt text (or its token ids and images) through the chat template
        (chat_templates.py), the tools and the tool-call history included (chat_render.py)."""
        messages, images = template_messages(chat, self.list_content)
        if not messages:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty (the chat has no messages)")
        if images and self.images is None:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the model {self.served_model_name!r} does not take images")
        try:
            tools = template_tools(chat)
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        try:
            text = render_chat(self.tokenizer, messages, chat_template=self.chat_template,
                               add_generation_prompt=chat.add_generation_prompt,
                               continue_final_message=chat.continue_final_message,
                               chat_template_kwargs=template_kwargs(chat), tools=tools)
        except ChatTemplateError as exc:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if not tokenize:
            return text
        return self._with_images(list(self.tokenizer.encode(text, add_special_tokens=False)), images)

    def _with_images(self, ids: list[int], images: list[bytes]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with its image tokens expanded, and its images (model_files/image_processing.py)."""
        if self.images is None:
            return ids, []
        processed = []
        for k, data in enumerate(images):
            try:
                processed.append(process_image(self.images, data))
            except ValueError as exc:
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"image {k} of the chat: {exc}") from None
        try:
            return expand_placeholders(self.images, ids, processed)
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    def _prompt_ids(self, request: generate_pb2.GenerateRequest) -> tuple[list[int], list[ImageInput]]:
        """The prompt's token ids (a chat's with its images' placeholders) and its images."""
        images: list[ImageInput] = []
        which = request.WhichOneof("input")
        if which == "prompt":
            ids = text_token_ids(self.tokenizer, request.prompt) if request.prompt else []
        elif which == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
            for i, tid in enumerate(ids):
                if tid >= self.vocab_limit:
                    raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"prompt_token_ids[{i}] = {tid} is out of range: the vocabulary has "
                                       f"{self.vocab_limit} tokens")
        elif which == "chat":
            ids, images = self._chat(request.chat, tokenize=True)
        else:
            ids = []
        if not ids:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
        keep = request.truncate_prompt_tokens
        if keep and len(ids) > keep:  # vLLM's truncate_prompt_tokens: the prompt's end is kept
            if images:
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"truncate_prompt_tokens={keep} would cut a "
                                  f"prompt of {len(ids)} tokens with images (their placeholders must stay whole)")
            return ids[-keep:], images
        request.truncate_prompt_tokens = 0  # nothing was cut (an echo shows the prompt as sent)
        return ids, images

    def _bad_words(self, request: generate_pb2.GenerateRequest) -> None:
        """vLLM's bad_words as token sequences into the params (common/bad_words.py)."""
        try:
            sequences = bad_words.token_sequences(
                list(request.bad_words), lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        del request.params.bad_words_token_ids[:]
        for seq in sequences:
            request.params.bad_words_token_ids.add(ids=seq)

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def tokenize(self, request: generate_pb2.TokenizeRequest) -> generate_pb2.TokenizeResponse:
        """/tokenize (tokenization.py): a prompt or a chat to token ids."""
        self._check_model(request.model)
        if request.WhichOneof("input") == "chat" and any(m.parts for m in request.chat.messages):
            return await self._in_thread(self._tokenize_with_images, request)
        return await self._in_thread(tokenization.tokenize, self.tokenizer, request,
                                     lambda chat: self._chat(chat, tokenize=False))

    def _tokenize_with_images(self, request: generate_pb2.TokenizeRequest) -> generate_pb2.TokenizeResponse:
        """A chat with images: its ids as Generate sends them (each image's placeholders expanded)."""
        ids, _ = self._chat(request.chat, tokenize=True)
        reply = generate_pb2.TokenizeResponse(token_ids=ids, text=self._chat(request.chat, tokenize=False))
        if request.return_token_strs:
            reply.token_strs.extend(self.tokenizer.convert_ids_to_tokens(ids))
        return reply

    async def detokenize(self, request: generate_pb2.DetokenizeRequest) -> generate_pb2.DetokenizeResponse:
        """/detokenize: on the tokenizer's own thread, never on the loop that detokenizes the
        streams (the gateway bounds the ids by the context)."""
        self._check_model(request.model)
        return await self._in_thread(tokenization.detokenize, self.tokenizer, request, self.vocab_limit)

    def _check_model(self, model: str) -> None:
        if other_model(model, generate_pb2.ModelInfo(model=self.served_model_name, aliases=self.served_aliases)):
            raise StatusError(grpc.StatusCode.NOT_FOUND,
                               f"the model {model!r} is not served here (this is {self.served_model_name!r})")

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:  # bounded by the vocabulary
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    async def model_info(self) -> generate_pb2.ModelInfo:
        info = generate_pb2.ModelInfo(model=self.served_model_name, aliases=self.served_aliases,
                                      vocab_size=len(self.tokenizer))
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            info.eos_token_id = self.tokenizer.eos_token_id
        info.takes_images = self.images is not None
        try:
            if self.router is not None:
                await self.router.refresh()
            theirs = await self.any_scheduler().GetModelInfo(generate_pb2.ModelInfoRequest(),
                                                             timeout=MODEL_INFO_TIMEOUT_S)
            info.max_model_len, info.ready = theirs.max_model_len, theirs.ready
            if theirs.HasField("max_logprobs"):
                info.max_logprobs = theirs.max_logprobs
        except grpc.aio.AioRpcError as exc:
            log.info("scheduler GetModelInfo failed (%s): reporting not ready", exc.code().name)
        return info

    # -- generation ---------------------------------------------------------------------------

    def _validate(self, request: generate_pb2.GenerateRequest) -> None:
        self._check_model(request.model)
        if len(request.stop) > MAX_STOP_STRINGS:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"too many stop strings: {len(request.stop)} (at most {MAX_STOP_STRINGS})")
        for i, s in enumerate(request.stop):
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"stop[{i}] has {len(s)} characters; a stop string must have 1 to "
                                   f"{MAX_STOP_STRING_CHARS}")

    async def start(self, request: generate_pb2.GenerateRequest, resume_grace_s: float = 0.0) -> RequestStream:
        """Validate and tokenize a request; its `responses()` then subscribe it at the scheduler.
        Raises StatusError for a bad request."""
        timings = common_pb2.Timings()
        timings.CopyFrom(request.timings)
        timings.tokenizer_received = time.time()
        self._validate(request)
        prompt_ids, images = await self._in_thread(self._prompt_ids, request)
        if request.bad_words:
            self._bad_words(request)
        apply_defaults(request.params, self.sampling_defaults)
        params = request.params
        too_many = prompt_logprobs_problem(params.n or 1, len(prompt_ids),
                                           params.prompt_logprobs if params.HasField("prompt_logprobs") else None)
        if too_many:  # before the scheduler stores anything
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, too_many)
        timings.tokenized = time.time()
        request_id = request.request_id or f"tok-{uuid.uuid4().hex}"
        schedule = scheduler_pb2.ScheduleRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                                 params=request.params, priority=request.priority, timings=timings)
        for image in images:
            image_to_proto(image, schedule.images.add())
        return RequestStream(self, request, schedule, timings, resume_grace_s=resume_grace_s)

    async def abort_sample(self, request_id: str, index: int, scheduler=None) -> None:
        """One of n samples hit a stop string here: the scheduler (the request's replica's) stops
        generating it."""
        try:
            await (scheduler or self.scheduler).Abort(scheduler_pb2.AbortRequest(request_id=request_id, index=index),
                                       timeout=MODEL_INFO_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.info("request %s: abort of sample %d failed (%s)", request_id, index, exc.code().name)

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

"""vLLM's offline API over the in-process engine: `LLM(model=..., **engine_args)` with
`generate(prompts, sampling_params)` and `chat(messages, sampling_params)`, returning one
RequestOutput per prompt (pagedserve.common.offline_types), and `embed(prompts)` with
runner="pooling" (engine/embeddings.py). AsyncLLM (async_llm.py) is the
streaming front over the same engine.

Engine arguments are the engine's settings, declared once in pagedserve.common.settings (the
flags of `pagedserve generate`, dashes as underscores: max_num_seqs, kv_cache_memory,
no_prefix_caching, ...) plus the EngineConfig fields named after vLLM's (enable_prefix_caching,
enable_chunked_prefill). Prompts are encoded as the tokenizer service encodes them (the
tokenizer's own special tokens), chats rendered by model_files.chat_templates as the service
renders them.

Threads: an LLM is used from one thread at a time (the engine and HF tokenizers are not
thread-safe). A bad prompt or parameter raises ValueError before any request is added.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagedserve.common import settings
from pagedserve.common.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, beam_width_problem
from pagedserve.common.request_checks import logprobs_limit, truncation_problem
from pagedserve.common.offline_types import RequestOutput, SamplingParams
from pagedserve.common.sampling_params import SamplingParams as EngineSamplingParams
from pagedserve.engine import embeddings
from pagedserve.engine.llm_engine import EngineConfig, LLMEngine, engine_config_from_args
from pagedserve.engine.text_requests import TextRequest
from pagedserve.common.multimodal import ImageInput
from pagedserve.model_files import chat_templates, image_processing, prompt_images
from pagedserve.model_files.image_processing import AnyImageConfig


def engine_config(model: str | None = None, **engine_args: Any) -> EngineConfig:
    """EngineConfig from keyword arguments named as the engine's settings (or EngineConfig's own
    fields); an unknown name raises TypeError listing the known ones."""
    names = set(settings.defaults("engine"))
    values = {**settings.defaults("engine"), "model": model}
    direct = {}
    for key, value in engine_args.items():
        if key in names:
            values[key] = value
        elif key in EngineConfig.__dataclass_fields__:
            direct[key] = value
        else:
            known = sorted(names | set(EngineConfig.__dataclass_fields__))
            raise TypeError(f"unknown engine argument {key!r}; known: {', '.join(known)}")
    config = engine_config_from_args(argparse.Namespace(**values), progress=False)
    for key, value in direct.items():
        setattr(config, key, value)
    return config


def load_engine(model: str | None, engine_args: dict[str, Any]) -> tuple[LLMEngine, Any, str | None]:
    """(engine, tokenizer, operator chat template) for LLM and AsyncLLM."""
    from pagedserve.model_files.default_model import resolve_model
    from pagedserve.model_files.tokenizer_files import load_tokenizer

    config = engine_config(model, **engine_args)
    chat_template = chat_templates.load_chat_template(config.chat_template)
    tokenizer = load_tokenizer(config.tokenizer or resolve_model(config.model, config.revision))
    engine = LLMEngine(config, tokenizer=tokenizer)
    return engine, tokenizer, chat_template


def as_params(params: EngineSamplingParams | None) -> EngineSamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, EngineSamplingParams):
        raise TypeError(f"sampling_params must be a pagedserve SamplingParams, got {type(params).__name__}")
    return params


def encode_prompt(tokenizer, prompt: Any, where: str) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) of a str, {"prompt": str} or {"prompt_token_ids": [...]}."""
    if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
        raise ValueError(f"{where}: multi_modal_data is taken by LLM.generate only")
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"{where}: prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        prompt = prompt.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: a prompt is a string, {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}; "
                         f"got {type(prompt).__name__}")
    return prompt, chat_templates.text_token_ids(tokenizer, prompt)


def encode_with_images(tokenizer, config: AnyImageConfig | None, prompt: Any,
                       where: str) -> tuple[str | None, list[int], list[ImageInput]]:
    """encode_prompt, and vLLM's {"prompt": ..., "multi_modal_data": {"image": image or [images]}}: one
    image token per image in the prompt, expanded to its placeholders (model_files/prompt_images.py)."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    if not data:
        return (*encode_prompt(tokenizer, prompt, where), [])
    text, ids = encode_prompt(tokenizer, {k: v for k, v in prompt.items() if k != "multi_modal_data"}, where)
    if config is None:
        raise ValueError(f"{where}: the model does not take images")
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"{where}: multi_modal_data takes \"image\" only, got {sorted(data)!r:.80}")
    try:
        ids, images = prompt_images.prompt_images(config, ids, data["image"])
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return text, ids, images


def encode_chat(tokenizer, config: AnyImageConfig | None, messages: list[dict],
                **options: Any) -> tuple[list[int], str, list[ImageInput]]:
    """(token ids, prompt text, images) of a chat, rendered as the tokenizer service renders it (with a
    model that takes images, its image parts prepared and their placeholders expanded); ValueError."""
    try:
        if config is not None:
            ids, images, text = prompt_images.chat_prompt(tokenizer, config, messages, **options)
            return ids, text, images
        return (*chat_templates.chat_token_ids(tokenizer, messages, **options), [])
    except chat_templates.ChatTemplateError as exc:
        raise ValueError(str(exc)) from None


def per_prompt(params, count: int) -> list[EngineSamplingParams]:
    if isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
        if len(params) != count:
            raise ValueError(f"{len(params)} sampling params for {count} prompts: give one, or one per prompt")
        return [as_params(p) for p in params]
    return [as_params(params)] * count


def truncated(text: str | None, ids: list[int], params, max_model_len: int) -> tuple[str | None, list[int]]:
    """vLLM's SamplingParams.truncate_prompt_tokens: the prompt's last k tokens (-1: the context's
    worth); the RequestOutput keeps the prompt's text as given."""
    k = getattr(params, "truncate_prompt_tokens", None)
    if k is None:
        return text, ids
    problem = truncation_problem(k, max_model_len)
    if problem:
        raise ValueError(problem)
    return text, ids[-(max_model_len if k == -1 else k):]


def shifted(images: list[ImageInput], cut: int, where: str) -> list[ImageInput]:
    """A prompt's images after truncate_prompt_tokens dropped its first `cut` tokens (none may be an image's)."""
    if cut and images and images[0].offset < cut:
        raise ValueError(f"{where}: truncate_prompt_tokens would cut into an image")
    return [dataclasses.replace(image, offset=image.offset - cut) for image in images] if cut else images


class LLM:
    """An engine in this process, used like vLLM's `LLM`."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine, self.tokenizer, self.chat_template = load_engine(model, engine_args)
        self.image_config = image_processing.image_config(  # None: a text model
            self.engine.model_path, self.tokenizer, self.engine.config.mm_processor_kwargs)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> EngineSamplingParams:
        """vLLM's: the model's generation config's sampling defaults (generation_config="auto"; max_new_tokens
        as max_tokens), else SamplingParams(); what generate and chat use when given none."""
        return SamplingParams(**self.engine.sampling_defaults)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. prompts: a string, {"prompt": str},
        {"prompt_token_ids": [...]}, or a list of those; sampling_params: one, or one per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        encoded = [encode_with_images(self.tokenizer, self.image_config, p, f"prompts[{i}]")
                   for i, p in enumerate(prompts)]
        return self._run([e[:2] for e in encoded], per_prompt(self._params(sampling_params), len(encoded)),
                         use_tqdm, [e[2] for e in encoded])

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search (common/beam_search.py): one BeamSearchOutput per prompt, its best
        beam_width beams best first, each beam's tokens and text the prompt's and the output's (vLLM's).
        Every step runs all prompts' live beams as one batch of one-token requests."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        problem = beam_width_problem(params.beam_width, logprobs_limit(self.engine.config.max_logprobs,
                                                                      self.engine.model_config.vocab_size))
        if problem:
            raise ValueError(problem)
        encoded = [encode_prompt(self.tokenizer, p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        self._check(encoded)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        eos = eos if eos is not None else next(iter(self.engine.eos_token_ids), None)
        searches = [BeamSearch(ids, params, eos) for _, ids in encoded]
        step = EngineSamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature,
                                    ignore_eos=True)
        bar = tqdm(total=params.max_tokens, desc="beam search", unit="step", disable=not use_tqdm)
        while active := [s for s in searches if not s.done]:
            beams = [beam for s in active for beam in s.live]
            outs = self._run([(None, beam.tokens) for beam in beams], [step] * len(beams), False)
            firsts = iter(out.outputs[0].logprobs[0] for out in outs)
            for search in active:
                search.step([[(t.token_id, t.logprob), *t.top_logprobs] for t in
                             itertools.islice(firsts, len(search.live))])
            bar.update(1)
        bar.close()
        results = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = self.tokenizer.decode(beam.tokens)
            results.append(BeamSearchOutput(best))
        return results

    def _params(self, sampling_params):
        return self.get_default_sampling_params() if sampling_params is None else sampling_params

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate from one chat (a list of {role, content}) or a list of chats, rendered by the
        model's chat template (or chat_template); one RequestOutput per chat."""
        chats = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded, images = [], []
        options = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       chat_template_kwargs=chat_template_kwargs, tools=tools)
        for i, chat in enumerate(chats):
            try:
                ids, text, placed = encode_chat(self.tokenizer, self.image_config, chat,
                                                chat_template=chat_template or self.chat_template, **options)
            except ValueError as exc:
                raise ValueError(f"messages[{i}]: {exc}" if len(chats) > 1 else str(exc)) from None
            encoded.append((text, ids))
            images.append(placed)
        return self._run(encoded, per_prompt(self._params(sampling_params), len(encoded)), use_tqdm, images)

    def embed(self, prompts, pooling_params=None, use_tqdm: bool = False) -> list:
        """vLLM's LLM.embed (runner="pooling"): one EmbeddingRequestOutput per prompt, in order
        (`.outputs.embedding`: the vector, pooled as the engine's pooler says, L2-normalised unless
        PoolingParams(normalize=False)). prompts as generate takes them."""
        config = self.engine.config
        params = embeddings.pooling_request_params(config.runner, config.pooler, pooling_params)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        encoded = [encode_prompt(self.tokenizer, p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        self._check(encoded)
        ids = [str(next(self._ids)) for _ in encoded]
        return embeddings.embed_all(self.engine, ids, encoded, params, use_tqdm)

    def _check(self, encoded: list[tuple[str | None, list[int]]]) -> None:
        """Every prompt checked before one is added."""
        engine = self.engine
        for i, (_, ids) in enumerate(encoded):
            if not ids:
                raise ValueError(f"prompts[{i}] is empty")
            try:
                engine.scheduler.check_prompt(len(ids))
            except ValueError as exc:
                raise ValueError(f"prompts[{i}]: {exc}") from None
            vocab = engine.model_config.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"prompts[{i}]: a token id is outside the vocabulary [0, {vocab})")

    def _run(self, encoded: list[tuple[str | None, list[int]]], params: list[EngineSamplingParams],
             use_tqdm: bool, images: list[list[ImageInput]] | None = None) -> list[RequestOutput]:
        engine = self.engine
        images = images or [[] for _ in encoded]
        cut = [truncated(text, ids, p, engine.max_model_len) for (text, ids), p in zip(encoded, params)]
        images = [shifted(placed, len(ids) - len(kept), f"prompts[{i}]")
                  for i, ((_, ids), (_, kept), placed) in enumerate(zip(encoded, cut, images))]
        encoded = cut
        self._check(encoded)
        requests = {str(next(self._ids)): (text, ids, p) for (text, ids), p in zip(encoded, params)}
        tracked = {rid: TextRequest(rid, text, ids, p, self.tokenizer) for rid, (text, ids, p) in requests.items()}
        placed = dict(zip(tracked, images))
        try:
            for rid, req in tracked.items():
                engine.add_request(rid, req.prompt_token_ids, req.params, images=placed[rid])
            bar = tqdm(total=len(tracked), desc="generating", unit="req", disable=not use_tqdm)
            unfinished = set(tracked)
            while unfinished:
                for out in engine.step():
                    req = tracked[out.request_id]
                    if req.apply(out):  # a stop string: the engine stops that sample (or all, n == 1)
                        engine.abort(out.request_id, out.sample_index if req.params.n > 1 else None)
                    if req.finished and out.request_id in unfinished:
                        unfinished.discard(out.request_id)
                        engine.abort(out.request_id)  # a stopped sample the engine could not abort alone
                        bar.update(1)
            bar.close()
        except BaseException:
            for rid in tracked:
                engine.abort(rid)
            raise
        return [req.output() for req in tracked.values()]

"""A step's image rows: where the scheduled positions of a multimodal request cover an image's
placeholder tokens, the text model's input embeddings there are that image's encoder rows
(row index = position - image offset), as transformers' LLaVA scatters them over its image tokens.

Each image is encoded once per request: the step that first reaches its placeholders encodes it (all
such images of the step in one batch through the tower) and keeps its rows on the request's state
(RequestState.image_rows) until the step that computes its last placeholder drops them. So chunked
prefill may split an image across steps, and a prefix-cache hit may start inside one; a preempted
request is resent as a new state and encodes again. The step is laid out eagerly (the model runner
passes no graph a step with image rows), decodes first then prefills, each state's `n` positions
from its num_computed_tokens: the order and counts the runner gives here. A text-only step costs a
scan of the states' image lists and nothing else. An M-RoPE model (Qwen2-VL) also takes each row's three
positions in such a step (step_inputs, mrope.py). A dynamic-resolution model's images each have their own
number of rows (its encode_images checks them); a Pixtral-family image's rows cover its span, break and end
tokens included (models/mistral3.py), so they are placed like any other's.
A bidirectional model (Gemma 3: an image's placeholders attend to each other both ways) gets its step's
AttentionMetadata.key_limits from mark_key_limits; its images are never split across steps. The model
runner's step thread only.
"""

from __future__ import annotations

import torch

from pagedserve.common.multimodal import ImageInput
from pagedserve.common.vision_config import image_problem
from pagedserve.worker import mrope


def _overlapping(state, n: int):
    """(index, image) of the state's images whose placeholders meet positions [computed, computed + n)."""
    start = state.num_computed_tokens
    return [(k, image) for k, image in enumerate(state.images) if image.offset < start + n and image.end > start]


def unservable(new_requests, vision: dict | None, step=None, states=None) -> dict[str, str]:
    """The step's new requests whose images this model cannot take (req_id -> why): they fail alone
    (ModelRunnerOutput.failed), as a client that bypassed the front end's checks deserves. With the step and
    the request states (its delta applied), a bidirectional model's requests whose chunk would split an image
    (a scheduler that does not know the rule: SchedulerConfig.whole_images) fail too, rather than the step."""
    problems = {new.req_id: image_problem(new.images, new.token_ids, vision) for new in new_requests if new.images}
    if step is not None and vision and vision.get("bidirectional"):
        for req_id, n in step.num_scheduled_tokens.items():
            state = states.get(req_id) if not problems.get(req_id) else None
            start = state.num_computed_tokens if state is not None else 0
            if state is not None and any(image.end > start + n for _, image in _overlapping(state, n)):
                problems[req_id] = ("the scheduler split an image across steps: this model computes an image's "
                                    "placeholders in one step (a scheduler older than the worker?)")
    return {req_id: why for req_id, why in problems.items() if why}


def profile_rows(model, vision: dict | None, num_tokens: int) -> list[torch.Tensor] | None:
    """The memory profile's images (model_runner._profile_peak): as many blank images as a step of
    num_tokens can touch, through the tower in one batch; their rows stay alive over the profiled forward,
    as a step's do. None for a text model."""
    if vision is None:
        return None
    if vision.get("family") == "pixtral":  # the largest image: max_side square, its span with breaks
        side = vision["max_side"]
        per = (side // (vision["patch_size"] * vision["merge_size"])) ** 2
        per += side // (vision["patch_size"] * vision["merge_size"])
        blank = ImageInput(0, per, side, side, bytes(side * side * 3))
    elif "num_image_tokens" in vision:
        side, per = vision["image_size"], vision["num_image_tokens"]
        blank = ImageInput(0, per, side, side, bytes(side * side * 3))
    else:  # dynamic resolution (Qwen2-VL): the largest square image max_pixels allows, the most patches each
        factor = vision["patch_size"] * vision["merge_size"]
        side = int(vision["max_pixels"] ** 0.5) // factor * factor
        per = (side // factor) ** 2
        blank = ImageInput(0, per, side, side, bytes(side * side * 3))
    return model.encode_images([blank] * (num_tokens // per + 2))


def has_image_rows(order, counts) -> bool:
    return any(state.images and _overlapping(state, n) for state, n in zip(order, counts))


def step_inputs(model, order, counts, input_ids: torch.Tensor) -> dict:
    """The model's extra keywords for the step: none without image rows; else `inputs_embeds`
    (step_embeddings), and for an M-RoPE model (Qwen2-VL: its vision has mrope_section) `mrope_positions`,
    every row's three positions (mrope.py)."""
    embeds = step_embeddings(model, order, counts, input_ids)
    if embeds is None:
        return {}
    vision = model.vision
    if "mrope_section" not in vision:
        return {"inputs_embeds": embeds}
    sections = mrope.step_section_positions(order, counts, vision["patch_size"] * vision["merge_size"])
    return {"inputs_embeds": embeds, "mrope_positions": torch.from_numpy(sections).to(input_ids.device)}


def mark_key_limits(metas, order, counts, positions: torch.Tensor, vision: dict | None) -> None:
    """A bidirectional model's (vision["bidirectional"]: Gemma 3) step with image rows: each meta's key_limits
    (attention.AttentionMetadata), the image's last placeholder position for its placeholders, each other
    query's own position. Nothing for another model, or a step that touches no image. The scheduler computes an
    image's placeholders in one step (scheduler/core/image_chunks.py); a step that splits one is refused here,
    since no attention could give transformers' rows for it."""
    if not vision or not vision.get("bidirectional"):
        return
    spans, base = [], 0  # (first flat row, rows, the image's last position)
    for state, n in zip(order, counts):
        if state.images:
            start = state.num_computed_tokens
            for _, image in _overlapping(state, n):
                if image.end > start + n:
                    raise ValueError(f"a step computes positions {start}..{start + n - 1} of an image at "
                                     f"{image.offset}..{image.end - 1}: this model needs all of an image's "
                                     "placeholders in one step")
                lo = max(image.offset, start)
                spans.append((base + lo - start, image.end - lo, image.end - 1))
        base += n
    if not spans:
        return
    limits = positions[:base].clone()
    for row, rows, last in spans:
        limits[row:row + rows] = last
    for meta in metas:
        meta.key_limits = limits


def step_embeddings(model, order, counts, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The step's input embeddings with its image rows in place, or None when it has none (the model
    then embeds input_ids itself, as for any text-only step)."""
    places, todo = [], []  # (flat row of the state's first position, state, image index, image); to encode
    base = 0
    for state, n in zip(order, counts):
        if state.images:
            for k, image in _overlapping(state, n):
                places.append((base, state, n, k, image))
                if state.image_rows is None or k not in state.image_rows:
                    todo.append((state, k, image))
        base += n
    if not places:
        return None
    if todo:
        for (state, k, _), rows in zip(todo, model.encode_images([image for _, _, image in todo])):
            state.image_rows = state.image_rows or {}
            state.image_rows[k] = rows
    embeds = model.embed_tokens(input_ids)
    for base, state, n, k, image in places:
        start = state.num_computed_tokens
        lo, hi = max(image.offset, start), min(image.end, start + n)
        embeds[base + lo - start:base + hi - start] = state.image_rows[k][lo - image.offset:hi - image.offset]
        if image.end <= start + n:  # its last placeholder is computed in this step
            del state.image_rows[k]
    return embeds

"""M-RoPE's positions (Qwen2-VL, Qwen2.5-VL: transformers' get_rope_index), as pure functions of a request's
images, and their place in the worker's steps.

M-RoPE turns each rotary frequency section by its own position: temporal, height, width (mrope_section
frequencies each). A text token's three positions are equal: its token index p plus a shift, the sum over
the request's images that end at or before p of (max(rows, cols) - length) (<= 0: an image of rows x cols
merged patches over rows * cols placeholders advances the positions by max(rows, cols) only). An image's
placeholder k (row i = k // cols, column j = k % cols) has positions (base, base + i, base + j), base = its
offset plus the shift before it. So for text M-RoPE is plain rope at a shifted position.

How the worker uses it: the KV slot mapping, the attention's lengths and every other layout value stay
token indices; only the positions the model's rotary reads change. InputBatch.rope_shift (set for an
M-RoPE model only: a text model's layouts call nothing) adds each row's shift to the laid-out positions
after the slots are computed from them and before the upload: eager steps, decode graphs (their padding
rows repeat row 0's shifted position, so they write row 0's slot with row 0's keys) and mixed-step graphs
alike. A step whose positions cover image placeholders runs eagerly (image_rows.has_image_rows) and the
model gets the full three sections there (section_positions, through image_rows.step_inputs).

Each state's RopeShifts is computed once, the first time one of its rows is laid out (RequestState.mrope),
and kept; forked samples take their parent's (request_states.commit), a preempted request is resent with its
images and computes it again. Numpy only; the model runner's step thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ImageGrid:
    offset: int  # its first placeholder's token index
    length: int  # rows * cols placeholders
    cols: int  # merged patches a row
    base: int  # its placeholders' temporal position: offset + the shift before it


@dataclass(frozen=True, slots=True)
class RopeShifts:
    """A request's images' effect on its positions: ends[i] is image i's end; shifts[i] the shift of a text
    token after exactly i images (shifts[0] = 0)."""
    ends: np.ndarray
    shifts: np.ndarray
    grids: tuple[ImageGrid, ...]

    @property
    def total(self) -> int:
        """The shift past the last image (every decode after the prompt)."""
        return int(self.shifts[-1])


NO_IMAGES = RopeShifts(np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64), ())


def rope_shifts(images, factor: int) -> RopeShifts:
    """ImageInputs in prompt order (height and width multiples of factor = patch_size * merge_size) ->
    their RopeShifts."""
    if not images:
        return NO_IMAGES
    shift, shifts, grids = 0, [0], []
    for image in images:
        rows, cols = image.height // factor, image.width // factor
        grids.append(ImageGrid(image.offset, image.length, cols, image.offset + shift))
        shift += max(rows, cols) - image.length
        shifts.append(shift)
    return RopeShifts(np.fromiter((i.end for i in images), dtype=np.int64, count=len(images)),
                      np.asarray(shifts, dtype=np.int64), tuple(grids))


def shifts_at(rope: RopeShifts, positions: np.ndarray) -> np.ndarray:
    """Each token index's text shift (an image's placeholders: the shift before the image)."""
    return rope.shifts[np.searchsorted(rope.ends, positions, side="right")]


def section_positions(rope: RopeShifts, start: int, n: int) -> np.ndarray:
    """[3, n]: the (temporal, height, width) positions of token indices start .. start + n."""
    p = np.arange(start, start + n, dtype=np.int64)
    out = np.repeat((p + shifts_at(rope, p))[None], 3, axis=0)
    for g in rope.grids:
        lo, hi = max(g.offset, start), min(g.offset + g.length, start + n)
        if lo < hi:
            k = np.arange(lo - g.offset, hi - g.offset)
            out[:, lo - start:hi - start] = (np.full_like(k, g.base), g.base + k // g.cols, g.base + k % g.cols)
    return out


def state_shifts(state, factor: int) -> RopeShifts:
    """The state's RopeShifts (computed on first use, then kept on it)."""
    if state.mrope is None:
        state.mrope = rope_shifts(state.images, factor)
    return state.mrope


class PositionShift:
    """InputBatch.rope_shift of an M-RoPE model: adds each laid-out row's shift to its position, in place.
    scheduled: (state, rows) in row order, as the layouts lay them (decodes first, then prefill runs)."""

    def __init__(self, vision: dict) -> None:
        self.factor = vision["patch_size"] * vision["merge_size"]

    def __call__(self, positions: np.ndarray, scheduled) -> None:
        start = 0
        for state, n in scheduled:
            rope = state.mrope if state.mrope is not None else state_shifts(state, self.factor)
            if rope.grids:
                rows = positions[start:start + n]
                rows += rope.total if rows[0] >= rope.ends[-1] else shifts_at(rope, rows)  # a decode: the first
            start += n


def position_shift(vision: dict | None) -> PositionShift | None:
    """The InputBatch.rope_shift of a model (ModelConfig.vision): None unless it is M-RoPE's."""
    return PositionShift(vision) if vision is not None and "mrope_section" in vision else None


def step_section_positions(order, counts, factor: int) -> np.ndarray:
    """[3, tokens]: an eager step's three positions per row (rows as the layouts lay them: each state's
    counts rows from its num_computed_tokens)."""
    return np.concatenate([section_positions(state_shifts(s, factor), s.num_computed_tokens, n)
                           for s, n in zip(order, counts)], axis=1)

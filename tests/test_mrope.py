"""M-RoPE's positions (worker/mrope.py) against transformers' get_rope_index (Qwen2-VL's and Qwen2.5-VL's) on
many random layouts: one to three images of different shapes, text between them (at least one token, as
<|vision_end|> and <|vision_start|> always put there), an image at the prompt's start or end, generated text
after; the three sections of every token, the same cut into arbitrary chunks, the text shift InputBatch's
layouts add (decode rows, prefill runs, spec-decode verification runs), and the shift past the prompt equal to
transformers' rope delta."""

from __future__ import annotations

import types

import numpy as np
import pytest

from pagedserve.common.multimodal import image_input
from pagedserve.worker.mrope import NO_IMAGES, PositionShift, rope_shifts, section_positions, step_section_positions
from pagedserve.worker.request_states import RequestState

IMAGE = 9
VISION = {"patch_size": 14, "merge_size": 2}


def transformers_rope_index(family: str, ids: list[int], grids: list[tuple[int, int]]):
    """transformers' get_rope_index on one sequence: ([3, tokens], its delta)."""
    import torch
    import transformers

    model_class = {"qwen2_vl": transformers.Qwen2VLModel, "qwen2_5_vl": transformers.Qwen2_5_VLModel}[family]
    holder = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=types.SimpleNamespace(
        spatial_merge_size=2, tokens_per_second=2)))
    holder.get_vision_position_ids = types.MethodType(model_class.get_vision_position_ids, holder)
    input_ids = torch.tensor([ids])
    thw = torch.tensor([[1, 2 * h, 2 * w] for h, w in grids]) if grids else None
    positions, delta = model_class.get_rope_index(holder, input_ids, (input_ids == IMAGE).int(), thw)
    return positions[:, 0].numpy(), int(delta[0, 0])


def layout(seed: int):
    """(prompt ids, ImageInputs, (rows, cols) per image) of a random prompt."""
    rng = np.random.default_rng(seed)
    ids, images, grids = [], [], []
    at_start = seed % 3 == 2
    for k in range(int(rng.integers(1, 4))):
        if k or not at_start:
            ids += rng.integers(10, 100, int(rng.integers(1, 6))).tolist()
        rows, cols = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        images.append(image_input(len(ids), rows * cols, 28 * rows, 28 * cols, bytes(28 * rows * 28 * cols * 3)))
        grids.append((rows, cols))
        ids += [IMAGE] * (rows * cols)
    if seed % 4 != 3:  # else the prompt ends with its last image
        ids += rng.integers(10, 100, int(rng.integers(1, 6))).tolist()
    return ids, images, grids


def state_of(ids, images, computed: int, spec=()) -> RequestState:
    return RequestState("r", list(ids), len(ids), None, [], computed, 0, [], [], images=tuple(images),
                        spec_token_ids=tuple(spec))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("seed", range(12))
def test_sections_equal_get_rope_index(family, seed):
    ids, images, grids = layout(seed)
    generated = [42, 43, 44]  # decode steps after the prompt: text
    expected, delta = transformers_rope_index(family, ids + generated, grids)
    rope = rope_shifts(images, 28)
    assert rope.total == delta  # transformers' rope delta: the shift of every token after the prompt
    np.testing.assert_array_equal(section_positions(rope, 0, len(ids) + 3), expected)
    # cut into chunks anywhere (inside images too): each chunk's sections are the whole's
    rng = np.random.default_rng(seed)
    cuts = sorted(set(rng.integers(1, len(ids), 4).tolist()) | {0, len(ids) + 3})
    chunks = [section_positions(rope, a, b - a) for a, b in zip(cuts[:-1], cuts[1:])]
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), expected)
    # a step of those chunks as the runner lays it out (step_section_positions: each state from its computed)
    states = [state_of(ids + generated, images, a) for a in cuts[:-1]]
    np.testing.assert_array_equal(
        step_section_positions(states, [b - a for a, b in zip(cuts[:-1], cuts[1:])], 28), expected)


@pytest.mark.parametrize("seed", range(12))
def test_the_layouts_text_shift(seed):
    """PositionShift adds to token indices what makes a text token's position transformers' (image
    placeholders get the shift before their image: their rows take section_positions instead)."""
    ids, images, grids = layout(seed)
    full = ids + [42, 43, 44, 45]
    expected, _ = transformers_rope_index("qwen2_vl", full, grids)
    text = np.asarray(full) != IMAGE
    shift = PositionShift(VISION)
    # a decode row at each text position, a prefill run from every cut, a verification run past the prompt
    rng = np.random.default_rng(seed)
    starts = sorted(set(rng.integers(0, len(ids), 3).tolist()))
    scheduled, positions = [], []
    for p in np.flatnonzero(text):
        scheduled.append((state_of(full, images, int(p)), 1))
        positions.append(int(p))
    for a in starts:
        scheduled.append((state_of(full, images, a), len(ids) - a))
        positions += range(a, len(ids))
    spec = state_of(full[:len(ids) + 1], images, len(ids), spec=full[len(ids) + 1:])
    scheduled.append((spec, 4))
    positions += range(len(ids), len(ids) + 4)
    laid = np.asarray(positions, dtype=np.int64)
    shift(laid, scheduled)
    index = np.asarray(positions)
    keep = text[index]
    np.testing.assert_array_equal(laid[keep], expected[0][index][keep])
    assert all(s.mrope.total == spec.mrope.total and s.mrope.grids == spec.mrope.grids for s, _ in scheduled)


def test_a_state_without_images_is_not_shifted():
    state = state_of([5, 6, 7], [], 1)
    laid = np.array([1, 2], dtype=np.int64)
    PositionShift(VISION)(laid, [(state, 2)])
    assert laid.tolist() == [1, 2] and state.mrope is NO_IMAGES

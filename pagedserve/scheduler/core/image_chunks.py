"""Whole images in prefill chunks, for a model whose image placeholders attend to each other both ways (Gemma 3:
SchedulerConfig.whole_images). transformers computes an image's placeholders together, each seeing all of
them; a step that computed only some of them could not see the rest (their keys do not exist yet), so a step
that computes any of an image's placeholders computes through its last one (vLLM's rule for such models).

chunk_images adjusts a chunk of `n` tokens from position `start`: an image the chunk would cut is left for the
next step (the chunk ends at the image's first placeholder), or, when the chunk starts at or inside the image
(nothing of it to leave: its start, or a prefix-cache hit that ended inside it), the chunk is extended to the
image's end, past the step's token budget if need be (the step then holds at most one image more than
max_num_batched_tokens allows: the worker profiles its memory at that size, vision_config.largest_step_tokens).
An image of more placeholders than max_num_batched_tokens is refused when the request arrives (image_problem):
no step could hold it.

Pure functions of the request's images (ImageInput offsets and lengths, in prompt order, not overlapping):
safe on any thread; the scheduler calls them from its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.common.multimodal import ImageInput


def chunk_images(images: Sequence[ImageInput], start: int, n: int) -> int:
    """The tokens to compute from `start` instead of n (n > 0), so that no image is split: n, less (cut back to
    the first image the chunk would split, never to 0), or more (through the end of the image the chunk starts at
    or in)."""
    end = start + n
    for image in images:
        if image.end <= start or image.end <= end:
            continue  # computed already, or whole in the chunk
        if image.offset >= end:
            break  # past the chunk (images are in order)
        return image.offset - start if image.offset > start else image.end - start
    return n


def image_problem(images: Sequence[ImageInput], max_num_batched_tokens: int) -> str | None:
    """Why these images can never be computed whole in a step, or None."""
    for image in images:
        if image.length > max_num_batched_tokens:
            return (f"an image of {image.length} placeholder tokens: this model computes an image's placeholders "
                    f"in one step, and --max-num-batched-tokens is {max_num_batched_tokens}; raise it")
    return None

"""The scheduler's rule for a model whose images are computed whole (SchedulerConfig.whole_images, Gemma 3's
bidirectional image attention: scheduler/core/image_chunks.py): a chunk never ends inside an image; it is cut
back to the image's first placeholder, or, starting at or inside the image, extended to its end (past the
budget if need be); an image longer than a step is refused on arrival. Without the flag, chunks are as before."""

from __future__ import annotations

import pytest

from pagedserve.common.multimodal import image_input
from pagedserve.common.vision_config import largest_step_tokens
from pagedserve.scheduler.core.image_chunks import chunk_images
from pagedserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler_driver import Driver, expected_outputs, make_request


def img(offset: int, length: int):
    return image_input(offset, length, 1, 1, bytes([offset % 256, length % 256, 7]))


IMAGES = (img(3, 4), img(9, 4))  # placeholders 3..6 and 9..12


@pytest.mark.parametrize("start, n, want", [
    (0, 3, 3),  # ends right before the first image
    (0, 5, 3),  # would end inside it: cut back to its start
    (0, 7, 7),  # the whole image inside the chunk
    (0, 10, 9),  # the first whole, the second cut: back to the second's start
    (3, 2, 4),  # starts at the image: extended through its end
    (5, 1, 2),  # starts inside it (a prefix-cache hit): through its end
    (7, 2, 2),  # text only
    (7, 4, 2),  # cut back to the second image
    (13, 5, 5),  # past every image
])
def test_chunk_images(start, n, want):
    assert chunk_images(IMAGES, start, n) == want


def run_chunks(cfg: SchedulerConfig, prompt: list[int], images) -> list[tuple[int, int]]:
    """The (start, tokens) of each step's chunk of one request, run to its end."""
    d = Driver(cfg)
    req = make_request("r", prompt, max_tokens=3)
    req.images = images
    d.add(req)
    chunks, done = [], 0
    while "r" not in d.outputs or len(d.outputs["r"]) < 3:
        out = d.step()
        n = out.num_scheduled_tokens.get("r", 0)
        if done < len(prompt):
            chunks.append((done, n))
        done += n
    assert d.outputs["r"] == expected_outputs(prompt, 3)[0]
    return chunks


def test_chunked_prefill_never_splits_an_image():
    prompt = list(range(100, 116))
    cfg = SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=5, whole_images=True)
    chunks = run_chunks(cfg, prompt, IMAGES)
    assert chunks == [(0, 3), (3, 5), (8, 5), (13, 3)]
    for start, n in chunks:
        assert all(not (image.offset < start + n < image.end) for image in IMAGES)
    # without the flag (every other model), the same prompt in budget-sized chunks, images split
    plain = run_chunks(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=5), prompt, IMAGES)
    assert plain == [(0, 5), (5, 5), (10, 5), (15, 1)]


def text_then_image_step(text_tokens: int):
    """(the scheduler, its first step) under a 6-token budget with whole images: a text prompt of text_tokens
    first, then a prompt opening with an image of 4."""
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=6, whole_images=True))
    text = make_request("text", list(range(50, 50 + text_tokens)), arrival=0)
    image = make_request("image", list(range(100, 110)), arrival=1)
    image.images = (img(0, 4),)
    sched.add_request(text)
    sched.add_request(image)
    return sched, sched.schedule()


def test_an_image_at_the_chunk_start_goes_past_the_cap_and_the_budget():
    """A long-prefill cap of 3 under an image of 4 at the prompt's start: the chunk is the whole image. With a
    6-token budget, 4 of it taken by another prompt, the image still goes whole (the step holds 8)."""
    cfg = SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=6, long_prefill_token_threshold=3,
                          whole_images=True)
    assert run_chunks(cfg, list(range(100, 110)), (img(0, 4),))[0] == (0, 4)
    sched, out = text_then_image_step(text_tokens=4)
    assert out.num_scheduled_tokens == {"text": 4, "image": 4}
    assert out.total_num_scheduled_tokens == 8 and sched._draft.budget == -2


def test_the_largest_step_is_the_one_the_worker_profiles():
    """The worst step: the budget's all but one token taken by another prompt, then a whole image: the budget
    plus the image less one token, which is the size the worker's memory profile runs
    (vision_config.largest_step_tokens); a text model's largest step is the budget."""
    vision = {"bidirectional": True, "num_image_tokens": 4}
    _, out = text_then_image_step(text_tokens=5)
    assert out.num_scheduled_tokens == {"text": 5, "image": 4}
    assert out.total_num_scheduled_tokens == largest_step_tokens(vision, 6) == 9
    assert largest_step_tokens(None, 6) == largest_step_tokens({"num_image_tokens": 4}, 6) == 6


def test_an_image_longer_than_a_step_is_refused():
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=3, whole_images=True))
    req = make_request("r", list(range(100, 110)))
    req.images = (img(2, 4),)
    with pytest.raises(ValueError, match="--max-num-batched-tokens is 3"):
        sched.add_request(req)
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        sched.check_prompt(10, (img(2, 4),))
    Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=3)).add_request(req)


def test_the_scheduler_service_reads_the_rule_from_the_worker_and_answers_400():
    """WorkerInfo.whole_images turns the rule on; an image longer than a step is INVALID_ARGUMENT (the
    gateway's 400) naming the flag, before anything is stored."""
    import grpc

    from fake_workers import started_service
    from pagedserve.common.grpc_util import StatusError
    from pagedserve.common.multimodal import image_to_proto
    from pagedserve.v1 import common_pb2, scheduler_pb2

    def request(length: int) -> scheduler_pb2.ScheduleRequest:
        msg = scheduler_pb2.ScheduleRequest(request_id="r", prompt_token_ids=list(range(10, 30)),
                                            params=common_pb2.SamplingParams(max_tokens=2, temperature=0.0))
        image_to_proto(img(2, length), msg.images.add())
        return msg

    for whole in (True, False):
        service = started_service(0.0, 6, whole_images=whole)
        try:
            assert service.scheduler.config.whole_images is whole
            service._validate("ok", request(6))
            if whole:
                with pytest.raises(StatusError) as refused:
                    service._validate("r", request(7))
                assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
                assert "--max-num-batched-tokens is 6" in refused.value.details
            else:
                service._validate("r", request(7))
        finally:
            service.stop()

"""Images on their way from the scheduler service to the worker, without a model: the prefix cache
keys blocks by the images they start, the step and record messages carry the pixels, a stored
request resumes with its images, and a retry under one id with another image is another request.

The scheduler service runs in-process over the fake worker group (tests/fake_workers.py) and the
real Redis under a fresh key prefix."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from fake_workers import expected, started_service

from pagedserve.common import wire
from pagedserve.common.grpc_util import StatusError
from pagedserve.common.messages import NewRequestData, SchedulerOutput
from pagedserve.common.multimodal import image_input, image_to_proto, images_from_json, images_to_json
from pagedserve.common.prefix_hashes import block_hashes, image_extras
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.scheduler.core.block_manager import BlockManager
from pagedserve.scheduler.records import resumed_requests
from pagedserve.scheduler.subscriptions import DeltaFilter, Outbox
from pagedserve.v1 import common_pb2, scheduler_pb2

IMAGE_TOKEN = 9


def pixels(seed: int, size: int = 4) -> bytes:
    return bytes((seed * 31 + i * 7) % 256 for i in range(size * size * 3))


def prompt_with_image(before: int, length: int, after: int) -> list[int]:
    return [1 + i % 7 for i in range(before)] + [IMAGE_TOKEN] * length + [20 + i % 5 for i in range(after)]


def test_a_block_is_named_by_the_image_it_starts_and_the_chain_carries_it():
    prompt = prompt_with_image(10, 8, 14)  # blocks of 4: the image starts in block 2
    red, blue = image_input(10, 8, 4, 4, pixels(1)), image_input(10, 8, 4, 4, pixels(2))
    assert image_extras([red], 4) == {2: bytes.fromhex(red.hash)}
    as_proto = scheduler_pb2.ScheduleRequest()
    image_to_proto(red, as_proto.images.add())
    assert image_extras(as_proto.images, 4) == image_extras([red], 4)  # the tokenizer's router reads the protos
    plain = block_hashes(prompt, 4)
    with_red = block_hashes(prompt, 4, extras=image_extras([red], 4))
    with_blue = block_hashes(prompt, 4, extras=image_extras([blue], 4))
    again = block_hashes(prompt, 4, extras=image_extras([image_input(10, 8, 4, 4, pixels(1))], 4))
    assert with_red == again
    assert with_red[:2] == with_blue[:2] == plain[:2]  # the text before the image is shared
    assert all(a != b for a, b in zip(with_red[2:], with_blue[2:]))  # from its block on, nothing is
    assert all(a != b for a, b in zip(with_red[2:], plain[2:]))


def test_the_block_manager_serves_a_prefix_past_an_image_only_for_the_same_image():
    prompt = prompt_with_image(6, 12, 9)
    red, blue = image_input(6, 12, 4, 4, pixels(1)), image_input(6, 12, 4, 4, pixels(2))
    bm = BlockManager(32, 4)
    bm.allocate("a", 0, len(prompt))
    bm.cache_full_blocks("a", prompt, len(prompt), extras=image_extras([red], 4))
    assert len(bm.find_cached_prefix("b", prompt, extras=image_extras([red], 4))) == 6
    assert len(bm.find_cached_prefix("c", prompt, extras=image_extras([blue], 4))) == 1  # block 0 only
    assert len(bm.find_cached_prefix("d", prompt)) == 1


def test_images_cross_the_step_message_and_the_record():
    images = [image_input(2, 3, 4, 4, pixels(3)), image_input(7, 2, 2, 2, pixels(4, 2))]
    step = SchedulerOutput(5, [NewRequestData("r", prompt_with_image(2, 3, 9), 14, SamplingParams(), [1, 2],
                                              0, images=images)], [], {"r": 14})
    back = wire.step_from_proto(wire.step_to_proto(step))
    assert back.new_requests[0].images == images
    assert images_from_json(images_to_json(images)) == tuple(images)
    with pytest.raises(ValueError, match="needs 48 bytes"):
        image_input(0, 1, 4, 4, b"short")


def schedule(request_id: str, prompt: list[int], images, max_tokens: int = 5) -> scheduler_pb2.ScheduleRequest:
    msg = scheduler_pb2.ScheduleRequest(
        request_id=request_id, prompt_token_ids=prompt,
        params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    for image in images:
        image_to_proto(image, msg.images.add())
    return msg


def run(service, msg) -> list[int]:
    async def main():
        outbox = Outbox(asyncio.get_running_loop())
        sub, group = service.submit(msg, outbox, 1)
        delta_filter = DeltaFilter.for_request(group.group_id, 1, [], sub.replayed, 1)
        tokens = []
        while not delta_filter.done:
            for _sub, item in await asyncio.wait_for(outbox.next_batch(), 30):
                for delta in delta_filter.deltas(*item):
                    tokens.extend(delta.token_ids)
        return tokens
    return asyncio.run(main())


@pytest.fixture
def service():
    service = started_service(0.0, 256)
    yield service
    service.stop()


def test_the_service_sends_the_worker_its_images_and_keeps_them_in_the_record(service):
    workers = service.workers
    seen: list[NewRequestData] = []
    original = workers.send
    workers.send = lambda out: (seen.extend(out.new_requests), original(out))[1]
    prompt = prompt_with_image(5, 20, 6)
    image = image_input(5, 20, 4, 4, pixels(7))
    assert run(service, schedule("img-1", prompt, [image])) == expected(prompt, 5)
    assert [r.images for r in seen if r.req_id == "img-1"] == [[image]]
    record = service.store.load("img-1")
    assert record.images == (image,)
    # What a restarted scheduler re-admits runs with the same images.
    unfinished = dataclasses.replace(record, finish_reasons=[""], outputs=[record.outputs[0][:2]])
    requests, _ = resumed_requests(unfinished, SamplingParams(max_tokens=50, ignore_eos=True), (), 512, 0.0)
    assert [r.images for r in requests] == [(image,)]
    # One id, the same prompt, another image: not a retry of that request.
    other = image_input(5, 20, 4, 4, pixels(8))
    with pytest.raises(StatusError) as refused:
        service.submit(schedule("img-1", prompt, [other]), Outbox(asyncio.new_event_loop()), 2)
    assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS


def test_images_that_do_not_fit_the_prompt_are_refused_before_anything_is_stored(service):
    prompt = prompt_with_image(5, 4, 0)
    for images in ([image_input(5, 5, 4, 4, pixels(1))],  # past the prompt's end
                   [image_input(2, 3, 4, 4, pixels(1)), image_input(3, 1, 4, 4, pixels(2))]):  # overlapping
        with pytest.raises(StatusError) as refused:
            service.submit(schedule("bad-img", prompt, images), Outbox(asyncio.new_event_loop()), 1)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "image placeholders" in refused.value.details
    assert service.store.load("bad-img") is None


def test_a_step_admits_at_most_its_share_of_pixels_and_the_rest_wait_for_the_next():
    """Each new request's images ride in the step's message (gRPC's cap: 64 MiB): the requests a step
    admits carry at most MAX_STEP_IMAGE_BYTES of pixels between them, but for the first, which always goes."""
    from pagedserve.scheduler.core.request import Request
    from pagedserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
    from pagedserve.scheduler.core.step_draft import MAX_STEP_IMAGE_BYTES

    side = 1024  # 3 MiB an image
    big = image_input(2, 4, side, side, bytes(side * side * 3))
    per_request = (MAX_STEP_IMAGE_BYTES // len(big.data)) // 2 + 1  # two such requests pass the cap
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=256, block_size=4, max_num_seqs=8, max_model_len=512,
                                      max_num_batched_tokens=512))
    for i in range(3):
        prompt = [1, 2] + [IMAGE_TOKEN] * (4 * per_request) + [3]
        images = tuple(image_input(2 + 4 * k, 4, side, side, big.data) for k in range(per_request))
        sched.add_request(Request(f"r{i}", prompt, len(prompt), SamplingParams(max_tokens=2), images=images))
    sched.add_request(Request("text", [5, 6, 7], 3, SamplingParams(max_tokens=2)))
    first = sched.schedule()
    assert [r.req_id for r in first.new_requests] == ["r0"]  # r1 would pass the cap: it and those after wait

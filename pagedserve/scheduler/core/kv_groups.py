"""The scheduler's side of KV groups (common/model_config.KVGroups): how many blocks a prompt needs
when sliding groups drop what leaves their window (and so whether a prompt can ever run here:
prompt_problem), and the step delta of one request (group 0's
table in the messages' original fields, groups 1.. in their `group_*` fields). No torch; called
from the step loop's thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.common.messages import CachedRequestData, NewRequestData
from pagedserve.common.request_checks import prompt_tokens_problem
from pagedserve.scheduler.core.block_manager import Allocation, BlockManager, cdiv
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.image_chunks import image_problem
from pagedserve.scheduler.core.request import Request


def make_block_manager(num_gpu_blocks: int, block_size: int, enable_prefix_caching: bool, num_cpu_blocks: int,
                       windows: Sequence[int]) -> BlockManager:
    return BlockManager(num_gpu_blocks, block_size, enable_prefix_caching, num_cpu_blocks, windows=windows)


def prompt_problem(config: SchedulerConfig, num_total_blocks: int, num_prompt_tokens: int,
                   images=()) -> str | None:
    """Why a prompt of that many tokens can never run under config (too long for the context,
    more blocks than the whole pool, more than a step's tokens unchunked, an image larger than a step
    where images are computed whole: image_chunks.py); None when it can."""
    problem = prompt_tokens_problem(num_prompt_tokens, config.max_model_len) or (
        image_problem(images, config.max_num_batched_tokens) if config.whole_images and images else None)
    if problem:
        return problem
    # (a whole image may take a chunk past the budget: image_chunks.py)
    longest = max((image.length for image in images), default=0) if config.whole_images else 0
    chunk = config.max_num_batched_tokens + longest if config.enable_chunked_prefill else num_prompt_tokens + 1
    need = blocks_for_sequence(config.kv_group_windows, config.block_size, num_prompt_tokens + 1, chunk)
    if need > num_total_blocks:
        return (f"the prompt needs {need} KV blocks of {config.block_size} tokens, but the "
                f"whole KV pool has {num_total_blocks}; raise --kv-cache-memory")
    if not config.enable_chunked_prefill and num_prompt_tokens > config.max_num_batched_tokens:
        return (f"the prompt has {num_prompt_tokens} tokens, more than max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) with chunked prefill disabled")
    return None


def blocks_for_sequence(windows: Sequence[int], block_size: int, num_tokens: int, max_chunk: int) -> int:
    """The most blocks one sequence of num_tokens holds at once, over all groups, when it is
    computed in chunks of at most max_chunk tokens: a full group holds all of it; a sliding group
    (window W) the blocks from the one holding `computed - W + 1` to the end of the chunk, plus
    the null block's share (not counted: it is held once for all)."""
    full = cdiv(num_tokens, block_size)
    total = 0
    for window in windows:
        if not window:
            total += full
        else:
            total += min(full, cdiv(window - 1 + max_chunk, block_size) + 1)
    return total


def step_entry(bm: BlockManager, req: Request, alloc: Allocation,
               whole_table: bool) -> NewRequestData | CachedRequestData:
    """What the worker needs of this request's tables this step (a request new to the worker:
    its whole tables)."""
    if not req.sent_to_worker:
        return NewRequestData(req.request_id, list(req.token_ids), req.num_prompt_tokens, req.params,
                              bm.block_ids(req.request_id), req.num_computed_tokens, req.sample_index,
                              list(req.child_req_ids), group_block_ids=bm.group_block_ids(req.request_id),
                              images=list(req.images))
    entry = CachedRequestData(req.request_id, alloc.new_block_ids[0], group_new_block_ids=alloc.new_block_ids[1:])
    if whole_table:
        entry.block_ids = bm.block_ids(req.request_id)
        entry.group_block_ids = bm.group_block_ids(req.request_id)
    for group, index, _src, dst in alloc.replaced:
        if group == 0:
            entry.replaced_block = (index, dst)
        else:
            entry.group_replaced.append((group, index, dst))
    return entry

"""The scheduler core's settings (SchedulerConfig), checked when made."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerConfig:
    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    policy: str = "fcfs"  # or "priority"
    # Most prompt tokens one request prefills in a step (0: no cap). Keeps steps short while a
    # long prompt prefills, so decodes and short prompts beside it are not held for seconds.
    long_prefill_token_threshold: int = 0
    # A prefill of more than long_prefill_token_threshold tokens to go leaves every other step to the
    # short prompts at the head of the waiting queue (short_first.py). False: first come, first served.
    short_prompts_first: bool = True
    # Per KV group (common/model_config.KVGroups): 0 full attention, else the sliding window.
    kv_group_windows: tuple[int, ...] = (0,)
    # Most distinct LoRA adapters among the running requests (--max-loras; a step's adapters are
    # a subset): a request of another adapter waits (counted as "seq_budget": the step's seats for
    # adapters are full). 0: LoRA off.
    max_loras: int = 0
    # A model whose image placeholders attend to each other both ways (Gemma 3): a step computes all of an
    # image's placeholders or none (image_chunks.py), and an image longer than a step is refused.
    whole_images: bool = False

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.preemption_mode == "swap" and self.num_cpu_blocks < 1:
            raise ValueError("preemption_mode 'swap' needs a host block pool (num_cpu_blocks >= 1)")

from pagedserve.v1 import common_pb2 as _common_pb2
from pagedserve.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScheduleRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "priority", "timings", "attach", "skip_tokens", "tag", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    priority: int
    timings: _common_pb2.Timings
    attach: bool
    skip_tokens: _containers.RepeatedScalarFieldContainer[int]
    tag: int
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageInput]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., attach: _Optional[bool] = ..., skip_tokens: _Optional[_Iterable[int]] = ..., tag: _Optional[int] = ..., images: _Optional[_Iterable[_Union[_common_pb2.ImageInput, _Mapping]]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "accepted", "timings", "n", "tag", "prompt_logprobs", "embedding")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    accepted: bool
    timings: _common_pb2.Timings
    n: int
    tag: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    embedding: bytes
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., accepted: _Optional[bool] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., n: _Optional[int] = ..., tag: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., embedding: _Optional[bytes] = ...) -> None: ...

class StreamCommand(_message.Message):
    __slots__ = ("schedule", "leave")
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    schedule: ScheduleRequest
    leave: int
    def __init__(self, schedule: _Optional[_Union[ScheduleRequest, _Mapping]] = ..., leave: _Optional[int] = ...) -> None: ...

class SubscriptionError(_message.Message):
    __slots__ = ("tag", "request_id", "code", "message")
    TAG_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    tag: int
    request_id: str
    code: int
    message: str
    def __init__(self, tag: _Optional[int] = ..., request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StepDeltas(_message.Message):
    __slots__ = ("deltas", "errors")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[TokenDelta]
    errors: _containers.RepeatedCompositeFieldContainer[SubscriptionError]
    def __init__(self, deltas: _Optional[_Iterable[_Union[TokenDelta, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[SubscriptionError, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_swapped", "num_gpu_blocks", "num_free_gpu_blocks", "num_cached_blocks", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens_total", "generation_tokens_total", "num_steps", "step_rtt_median_s", "step_time_median_s", "ready", "max_waiting_requests", "requests_finished_total", "worker_busy_seconds_total", "step_seconds_total", "idle_seconds_total", "step_scheduled_tokens", "step_token_budget_utilization", "step_duration_seconds", "scheduled_prefill_tokens_total", "scheduled_decode_tokens_total", "waiting_reasons_total", "max_num_seqs", "max_num_batched_tokens", "healthy", "unhealthy_cause", "num_worker_recoveries", "spec_decode_enabled", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_RTT_MEDIAN_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MEDIAN_S_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WORKER_BUSY_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEP_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKEN_BUDGET_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    STEP_DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_PREFILL_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_DECODE_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WAITING_REASONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_CAUSE_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKER_RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_ENABLED_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_swapped: int
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_steps: int
    step_rtt_median_s: float
    step_time_median_s: float
    ready: bool
    max_waiting_requests: int
    requests_finished_total: int
    worker_busy_seconds_total: float
    step_seconds_total: float
    idle_seconds_total: float
    step_scheduled_tokens: HistogramData
    step_token_budget_utilization: HistogramData
    step_duration_seconds: HistogramData
    scheduled_prefill_tokens_total: int
    scheduled_decode_tokens_total: int
    waiting_reasons_total: WaitingReasons
    max_num_seqs: int
    max_num_batched_tokens: int
    healthy: bool
    unhealthy_cause: str
    num_worker_recoveries: int
    spec_decode_enabled: bool
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_swapped: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_free_gpu_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., generation_tokens_total: _Optional[int] = ..., num_steps: _Optional[int] = ..., step_rtt_median_s: _Optional[float] = ..., step_time_median_s: _Optional[float] = ..., ready: _Optional[bool] = ..., max_waiting_requests: _Optional[int] = ..., requests_finished_total: _Optional[int] = ..., worker_busy_seconds_total: _Optional[float] = ..., step_seconds_total: _Optional[float] = ..., idle_seconds_total: _Optional[float] = ..., step_scheduled_tokens: _Optional[_Union[HistogramData, _Mapping]] = ..., step_token_budget_utilization: _Optional[_Union[HistogramData, _Mapping]] = ..., step_duration_seconds: _Optional[_Union[HistogramData, _Mapping]] = ..., scheduled_prefill_tokens_total: _Optional[int] = ..., scheduled_decode_tokens_total: _Optional[int] = ..., waiting_reasons_total: _Optional[_Union[WaitingReasons, _Mapping]] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., healthy: _Optional[bool] = ..., unhealthy_cause: _Optional[str] = ..., num_worker_recoveries: _Optional[int] = ..., spec_decode_enabled: _Optional[bool] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ...) -> None: ...

class HistogramData(_message.Message):
    __slots__ = ("bounds", "counts", "sum")
    BOUNDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    bounds: _containers.RepeatedScalarFieldContainer[float]
    counts: _containers.RepeatedScalarFieldContainer[int]
    sum: float
    def __init__(self, bounds: _Optional[_Iterable[float]] = ..., counts: _Optional[_Iterable[int]] = ..., sum: _Optional[float] = ...) -> None: ...

class WaitingReasons(_message.Message):
    __slots__ = ("no_blocks", "seq_budget", "token_budget")
    NO_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEQ_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    no_blocks: int
    seq_budget: int
    token_budget: int
    def __init__(self, no_blocks: _Optional[int] = ..., seq_budget: _Optional[int] = ..., token_budget: _Optional[int] = ...) -> None: ...

class EngineStatsRequest(_message.Message):
    __slots__ = ("max_steps",)
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    max_steps: int
    def __init__(self, max_steps: _Optional[int] = ...) -> None: ...

class EngineConfig(_message.Message):
    __slots__ = ("max_num_batched_tokens", "max_num_seqs", "block_size", "num_gpu_blocks", "max_model_len", "num_cpu_blocks", "preemption_mode", "enable_prefix_caching")
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_MODE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    num_gpu_blocks: int
    max_model_len: int
    num_cpu_blocks: int
    preemption_mode: str
    enable_prefix_caching: bool
    def __init__(self, max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., block_size: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., preemption_mode: _Optional[str] = ..., enable_prefix_caching: _Optional[bool] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("request_id", "block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("step", "time", "duration_s", "scheduled_tokens", "prefill_tokens", "decode_tokens", "num_seqs", "token_budget", "seq_budget", "blocks_used", "blocks_cached", "blocks_free", "preemptions", "waiting", "waiting_reasons", "running", "swapped")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SEQ_BUDGET_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    WAITING_REASONS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    step: int
    time: float
    duration_s: float
    scheduled_tokens: int
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    token_budget: int
    seq_budget: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    preemptions: int
    waiting: int
    waiting_reasons: WaitingReasons
    running: int
    swapped: int
    def __init__(self, step: _Optional[int] = ..., time: _Optional[float] = ..., duration_s: _Optional[float] = ..., scheduled_tokens: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., decode_tokens: _Optional[int] = ..., num_seqs: _Optional[int] = ..., token_budget: _Optional[int] = ..., seq_budget: _Optional[int] = ..., blocks_used: _Optional[int] = ..., blocks_cached: _Optional[int] = ..., blocks_free: _Optional[int] = ..., preemptions: _Optional[int] = ..., waiting: _Optional[int] = ..., waiting_reasons: _Optional[_Union[WaitingReasons, _Mapping]] = ..., running: _Optional[int] = ..., swapped: _Optional[int] = ...) -> None: ...

class PrefillChunk(_message.Message):
    __slots__ = ("time", "tokens")
    TIME_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    time: float
    tokens: int
    def __init__(self, time: _Optional[float] = ..., tokens: _Optional[int] = ...) -> None: ...

class RecentRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "output_tokens", "finish_reason", "timings", "finish_reasons", "cached_tokens", "prefill_chunks", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    timings: _common_pb2.Timings
    finish_reasons: _containers.RepeatedScalarFieldContainer[str]
    cached_tokens: int
    prefill_chunks: _containers.RepeatedCompositeFieldContainer[PrefillChunk]
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., finish_reasons: _Optional[_Iterable[str]] = ..., cached_tokens: _Optional[int] = ..., prefill_chunks: _Optional[_Iterable[_Union[PrefillChunk, _Mapping]]] = ..., adapter: _Optional[str] = ...) -> None: ...

class EngineTotals(_message.Message):
    __slots__ = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "num_steps", "prompt_tokens", "generation_tokens", "waiting_reasons", "prefill_tokens", "decode_tokens", "requests_finished")
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REASONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps: int
    prompt_tokens: int
    generation_tokens: int
    waiting_reasons: WaitingReasons
    prefill_tokens: int
    decode_tokens: int
    requests_finished: int
    def __init__(self, num_preemptions: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_steps: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generation_tokens: _Optional[int] = ..., waiting_reasons: _Optional[_Union[WaitingReasons, _Mapping]] = ..., prefill_tokens: _Optional[int] = ..., decode_tokens: _Optional[int] = ..., requests_finished: _Optional[int] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("time", "config", "waiting", "running", "swapped", "num_blocks", "block_states", "tables", "steps", "recent_requests", "totals", "ready", "num_waiting", "num_running", "num_swapped")
    TIME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STATES_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RECENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    time: float
    config: EngineConfig
    waiting: _containers.RepeatedScalarFieldContainer[str]
    running: _containers.RepeatedScalarFieldContainer[str]
    swapped: _containers.RepeatedScalarFieldContainer[str]
    num_blocks: int
    block_states: str
    tables: _containers.RepeatedCompositeFieldContainer[BlockTable]
    steps: _containers.RepeatedCompositeFieldContainer[StepStats]
    recent_requests: _containers.RepeatedCompositeFieldContainer[RecentRequest]
    totals: EngineTotals
    ready: bool
    num_waiting: int
    num_running: int
    num_swapped: int
    def __init__(self, time: _Optional[float] = ..., config: _Optional[_Union[EngineConfig, _Mapping]] = ..., waiting: _Optional[_Iterable[str]] = ..., running: _Optional[_Iterable[str]] = ..., swapped: _Optional[_Iterable[str]] = ..., num_blocks: _Optional[int] = ..., block_states: _Optional[str] = ..., tables: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ..., steps: _Optional[_Iterable[_Union[StepStats, _Mapping]]] = ..., recent_requests: _Optional[_Iterable[_Union[RecentRequest, _Mapping]]] = ..., totals: _Optional[_Union[EngineTotals, _Mapping]] = ..., ready: _Optional[bool] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_swapped: _Optional[int] = ...) -> None: ...

class GetRequestRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RequestRecord(_message.Message):
    __slots__ = ("request_id", "status", "prompt_token_ids", "params", "outputs", "finish_reasons", "timings", "priority", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    outputs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenIds]
    finish_reasons: _containers.RepeatedScalarFieldContainer[str]
    timings: _common_pb2.Timings
    priority: int
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageInput]
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., outputs: _Optional[_Iterable[_Union[_generate_pb2.TokenIds, _Mapping]]] = ..., finish_reasons: _Optional[_Iterable[str]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., priority: _Optional[int] = ..., images: _Optional[_Iterable[_Union[_common_pb2.ImageInput, _Mapping]]] = ...) -> None: ...

from pagedserve.v1 import common_pb2 as _common_pb2
from pagedserve.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScheduleRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "priority", "timings", "attach", "skip_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    priority: int
    timings: _common_pb2.Timings
    attach: bool
    skip_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., attach: _Optional[bool] = ..., skip_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "accepted", "timings", "n")
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
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., accepted: _Optional[bool] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., n: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("num_running", "num_waiting", "num_swapped", "num_gpu_blocks", "num_free_gpu_blocks", "num_cached_blocks", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens_total", "generation_tokens_total", "num_steps", "step_rtt_median_s", "step_time_median_s", "ready", "max_waiting_requests", "requests_finished_total", "worker_busy_seconds_total", "step_seconds_total", "idle_seconds_total")
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
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_swapped: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_free_gpu_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., generation_tokens_total: _Optional[int] = ..., num_steps: _Optional[int] = ..., step_rtt_median_s: _Optional[float] = ..., step_time_median_s: _Optional[float] = ..., ready: _Optional[bool] = ..., max_waiting_requests: _Optional[int] = ..., requests_finished_total: _Optional[int] = ..., worker_busy_seconds_total: _Optional[float] = ..., step_seconds_total: _Optional[float] = ..., idle_seconds_total: _Optional[float] = ...) -> None: ...

class GetRequestRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RequestRecord(_message.Message):
    __slots__ = ("request_id", "status", "prompt_token_ids", "params", "outputs", "finish_reasons", "timings", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    outputs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenIds]
    finish_reasons: _containers.RepeatedScalarFieldContainer[str]
    timings: _common_pb2.Timings
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., outputs: _Optional[_Iterable[_Union[_generate_pb2.TokenIds, _Mapping]]] = ..., finish_reasons: _Optional[_Iterable[str]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., priority: _Optional[int] = ...) -> None: ...

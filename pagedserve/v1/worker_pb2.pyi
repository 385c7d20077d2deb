from pagedserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("rank", "world_size", "model", "dtype", "device", "max_model_len", "vocab_size", "eos_token_ids", "weight_bytes", "step_socket", "whole_images")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    WHOLE_IMAGES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    model: str
    dtype: str
    device: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    weight_bytes: int
    step_socket: str
    whole_images: bool
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., weight_bytes: _Optional[int] = ..., step_socket: _Optional[str] = ..., whole_images: _Optional[bool] = ...) -> None: ...

class ProfileRequest(_message.Message):
    __slots__ = ("block_size", "kv_cache_memory", "swap_space", "max_num_batched_tokens", "gpu_memory_utilization")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    SWAP_SPACE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    kv_cache_memory: str
    swap_space: str
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    def __init__(self, block_size: _Optional[int] = ..., kv_cache_memory: _Optional[str] = ..., swap_space: _Optional[str] = ..., max_num_batched_tokens: _Optional[int] = ..., gpu_memory_utilization: _Optional[float] = ...) -> None: ...

class ProfileResponse(_message.Message):
    __slots__ = ("num_gpu_blocks", "num_cpu_blocks", "bytes_per_block", "kv_group_windows")
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    num_gpu_blocks: int
    num_cpu_blocks: int
    bytes_per_block: int
    kv_group_windows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., kv_group_windows: _Optional[_Iterable[int]] = ...) -> None: ...

class InitCacheRequest(_message.Message):
    __slots__ = ("num_gpu_blocks", "num_cpu_blocks", "block_size", "session_id")
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    session_id: str
    def __init__(self, num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class InitCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "params", "block_ids", "num_computed_tokens", "sample_index", "child_req_ids", "group_block_ids", "images")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHILD_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    params: _common_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    sample_index: int
    child_req_ids: _containers.RepeatedScalarFieldContainer[str]
    group_block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageInput]
    def __init__(self, req_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., sample_index: _Optional[int] = ..., child_req_ids: _Optional[_Iterable[str]] = ..., group_block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., images: _Optional[_Iterable[_Union[_common_pb2.ImageInput, _Mapping]]] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GroupReplacedBlock(_message.Message):
    __slots__ = ("group", "index", "block_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    group: int
    index: int
    block_id: int
    def __init__(self, group: _Optional[int] = ..., index: _Optional[int] = ..., block_id: _Optional[int] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("req_id", "new_block_ids", "replaced_index", "replaced_block_id", "has_block_ids", "block_ids", "group_new_block_ids", "group_replaced", "group_block_ids")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLACED_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPLACED_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_REPLACED_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    replaced_index: int
    replaced_block_id: int
    has_block_ids: bool
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    group_new_block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    group_replaced: _containers.RepeatedCompositeFieldContainer[GroupReplacedBlock]
    group_block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    def __init__(self, req_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., replaced_index: _Optional[int] = ..., replaced_block_id: _Optional[int] = ..., has_block_ids: _Optional[bool] = ..., block_ids: _Optional[_Iterable[int]] = ..., group_new_block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., group_replaced: _Optional[_Iterable[_Union[GroupReplacedBlock, _Mapping]]] = ..., group_block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ...) -> None: ...

class BlockPair(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "session_id", "new_requests", "cached_requests", "scheduled_req_ids", "num_scheduled_tokens", "finished_req_ids", "blocks_to_copy", "blocks_to_swap_out", "blocks_to_swap_in", "spec_tokens", "grammars")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_COPY_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMARS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    session_id: str
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    scheduled_req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    blocks_to_copy: _containers.RepeatedCompositeFieldContainer[BlockPair]
    blocks_to_swap_out: _containers.RepeatedCompositeFieldContainer[BlockPair]
    blocks_to_swap_in: _containers.RepeatedCompositeFieldContainer[BlockPair]
    spec_tokens: _containers.RepeatedCompositeFieldContainer[SpecTokens]
    grammars: _containers.RepeatedCompositeFieldContainer[_common_pb2.StructuredOutput]
    def __init__(self, step_id: _Optional[int] = ..., session_id: _Optional[str] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., scheduled_req_ids: _Optional[_Iterable[str]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., blocks_to_copy: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., blocks_to_swap_out: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., blocks_to_swap_in: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., spec_tokens: _Optional[_Iterable[_Union[SpecTokens, _Mapping]]] = ..., grammars: _Optional[_Iterable[_Union[_common_pb2.StructuredOutput, _Mapping]]] = ...) -> None: ...

class SpecTokens(_message.Message):
    __slots__ = ("req_id", "token_ids")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SampledTokens(_message.Message):
    __slots__ = ("req_id", "tokens")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, req_id: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("req_id", "start", "tokens")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    start: int
    tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, req_id: _Optional[str] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class PooledOutput(_message.Message):
    __slots__ = ("req_id", "data")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    data: bytes
    def __init__(self, req_id: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled", "forward_time_s", "sample_time_s", "worker_time_s", "prompt_logprobs", "pooled", "failed", "grammars_ready")
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    WORKER_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    GRAMMARS_READY_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledTokens]
    forward_time_s: float
    sample_time_s: float
    worker_time_s: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    pooled: _containers.RepeatedCompositeFieldContainer[PooledOutput]
    failed: _containers.ScalarMap[str, str]
    grammars_ready: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledTokens, _Mapping]]] = ..., forward_time_s: _Optional[float] = ..., sample_time_s: _Optional[float] = ..., worker_time_s: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., pooled: _Optional[_Iterable[_Union[PooledOutput, _Mapping]]] = ..., failed: _Optional[_Mapping[str, str]] = ..., grammars_ready: _Optional[_Iterable[str]] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "structured_output", "logit_bias", "prompt_logprobs", "cache_salt", "pooling", "lora_name", "lora_path", "allowed_token_ids", "bad_words_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    structured_output: StructuredOutput
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    cache_salt: str
    pooling: Pooling
    lora_name: str
    lora_path: str
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., cache_salt: _Optional[str] = ..., pooling: _Optional[_Union[Pooling, _Mapping]] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Pooling(_message.Message):
    __slots__ = ("type", "normalize")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    type: str
    normalize: bool
    def __init__(self, type: _Optional[str] = ..., normalize: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "reasoning_end", "structural_tag")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    REASONING_END_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    grammar: str
    reasoning_end: str
    structural_tag: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., grammar: _Optional[str] = ..., reasoning_end: _Optional[str] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("gateway_received", "tokenizer_received", "tokenized", "scheduler_received", "first_scheduled", "first_token", "finished", "detokenized", "worker_time_s", "num_steps", "num_preemptions", "prefill_chunks", "prefill_end", "first_token_streamed", "last_token_streamed", "spec_draft_tokens", "spec_accepted_tokens")
    GATEWAY_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TOKENIZED_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    FIRST_SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZED_FIELD_NUMBER: _ClassVar[int]
    WORKER_TIME_S_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_END_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_STREAMED_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_STREAMED_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    gateway_received: float
    tokenizer_received: float
    tokenized: float
    scheduler_received: float
    first_scheduled: float
    first_token: float
    finished: float
    detokenized: float
    worker_time_s: float
    num_steps: int
    num_preemptions: int
    prefill_chunks: int
    prefill_end: float
    first_token_streamed: float
    last_token_streamed: float
    spec_draft_tokens: int
    spec_accepted_tokens: int
    def __init__(self, gateway_received: _Optional[float] = ..., tokenizer_received: _Optional[float] = ..., tokenized: _Optional[float] = ..., scheduler_received: _Optional[float] = ..., first_scheduled: _Optional[float] = ..., first_token: _Optional[float] = ..., finished: _Optional[float] = ..., detokenized: _Optional[float] = ..., worker_time_s: _Optional[float] = ..., num_steps: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prefill_chunks: _Optional[int] = ..., prefill_end: _Optional[float] = ..., first_token_streamed: _Optional[float] = ..., last_token_streamed: _Optional[float] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class LocalSocketRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LocalSocket(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class ImageInput(_message.Message):
    __slots__ = ("offset", "length", "height", "width", "data", "hash")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    height: int
    width: int
    data: bytes
    hash: str
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., data: _Optional[bytes] = ..., hash: _Optional[str] = ...) -> None: ...

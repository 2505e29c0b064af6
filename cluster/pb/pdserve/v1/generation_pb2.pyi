from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "messages", "sampling", "cache_salt", "add_special_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: TokenIds
    messages: Messages
    sampling: SamplingParams
    cache_salt: str
    add_special_tokens: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[Messages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Messages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop", "stop_token_ids", "ignore_eos", "logprobs", "repetition_penalty", "frequency_penalty", "presence_penalty", "include_stop_str_in_output")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    n: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    include_stop_str_in_output: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "text", "finish_reason", "stop_string", "stop_token_id", "usage", "timing", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stop_string: str
    stop_token_id: int
    usage: Usage
    timing: Timing
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("time_to_first_token_s", "elapsed_s")
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    time_to_first_token_s: float
    elapsed_s: float
    def __init__(self, time_to_first_token_s: _Optional[float] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "max_model_len", "block_size", "vocab_size", "pools", "max_prompt_tokens", "max_stop_strings", "max_n", "version", "tokenizer_vocab_size")
    class PoolsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    block_size: int
    vocab_size: int
    pools: _containers.ScalarMap[str, int]
    max_prompt_tokens: int
    max_stop_strings: int
    max_n: int
    version: str
    tokenizer_vocab_size: int
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., pools: _Optional[_Mapping[str, int]] = ..., max_prompt_tokens: _Optional[int] = ..., max_stop_strings: _Optional[int] = ..., max_n: _Optional[int] = ..., version: _Optional[str] = ..., tokenizer_vocab_size: _Optional[int] = ...) -> None: ...

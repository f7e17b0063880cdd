from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdapterLoad(_message.Message):
    __slots__ = ("name", "slot")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    name: str
    slot: int
    def __init__(self, name: _Optional[str] = ..., slot: _Optional[int] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "strict", "end_token_ids", "scope")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    strict: bool
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    scope: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., strict: _Optional[bool] = ..., end_token_ids: _Optional[_Iterable[int]] = ..., scope: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckConstraintResponse(_message.Message):
    __slots__ = ("error", "compile_ms", "cached", "compile_cpu_ms")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPILE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    COMPILE_CPU_MS_FIELD_NUMBER: _ClassVar[int]
    error: str
    compile_ms: float
    cached: bool
    compile_cpu_ms: float
    def __init__(self, error: _Optional[str] = ..., compile_ms: _Optional[float] = ..., cached: _Optional[bool] = ..., compile_cpu_ms: _Optional[float] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model", "model_path", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size", "max_position_embeddings", "dtype", "kv_dtype", "block_size", "num_device_pages", "num_host_pages", "page_bytes", "attention_backend", "device", "eos_token_ids", "executor_id", "swap_bytes_per_second", "prefill_seconds_per_token", "kv_bytes_per_token", "default_temperature", "default_top_p", "default_top_k", "model_sliding_window", "protocol", "default_repetition_penalty", "default_min_p", "adapters", "lora_slots", "lora_slot_pages", "lora_max_rank", "lora_modules", "lora_runtime", "exact_tail_pages")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    SWAP_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TOP_P_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    MODEL_SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MIN_P_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOT_PAGES_FIELD_NUMBER: _ClassVar[int]
    LORA_MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_MODULES_FIELD_NUMBER: _ClassVar[int]
    LORA_RUNTIME_FIELD_NUMBER: _ClassVar[int]
    EXACT_TAIL_PAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_path: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    kv_dtype: str
    block_size: int
    num_device_pages: int
    num_host_pages: int
    page_bytes: int
    attention_backend: str
    device: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    executor_id: str
    swap_bytes_per_second: float
    prefill_seconds_per_token: float
    kv_bytes_per_token: int
    default_temperature: float
    default_top_p: float
    default_top_k: int
    model_sliding_window: int
    protocol: int
    default_repetition_penalty: float
    default_min_p: float
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    lora_slots: int
    lora_slot_pages: int
    lora_max_rank: int
    lora_modules: _containers.RepeatedScalarFieldContainer[str]
    lora_runtime: bool
    exact_tail_pages: int
    def __init__(self, model: _Optional[str] = ..., model_path: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_device_pages: _Optional[int] = ..., num_host_pages: _Optional[int] = ..., page_bytes: _Optional[int] = ..., attention_backend: _Optional[str] = ..., device: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., executor_id: _Optional[str] = ..., swap_bytes_per_second: _Optional[float] = ..., prefill_seconds_per_token: _Optional[float] = ..., kv_bytes_per_token: _Optional[int] = ..., default_temperature: _Optional[float] = ..., default_top_p: _Optional[float] = ..., default_top_k: _Optional[int] = ..., model_sliding_window: _Optional[int] = ..., protocol: _Optional[int] = ..., default_repetition_penalty: _Optional[float] = ..., default_min_p: _Optional[float] = ..., adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ..., lora_slots: _Optional[int] = ..., lora_slot_pages: _Optional[int] = ..., lora_max_rank: _Optional[int] = ..., lora_modules: _Optional[_Iterable[str]] = ..., lora_runtime: _Optional[bool] = ..., exact_tail_pages: _Optional[int] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "rank", "num_bytes", "num_pages", "slot", "runtime")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    num_bytes: int
    num_pages: int
    slot: int
    runtime: bool
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., num_bytes: _Optional[int] = ..., num_pages: _Optional[int] = ..., slot: _Optional[int] = ..., runtime: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "min_tokens_stop_ids", "logit_bias", "allowed_token_ids", "bad_words", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    min_tokens_stop_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    top_logprobs: int
    prompt_logprobs: bool
    prompt_top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., min_tokens_stop_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., prompt_top_logprobs: _Optional[int] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_computed_tokens", "num_scheduled_tokens", "page_ids", "sampling", "num_output_tokens", "sink_tokens", "window_tokens", "constraint", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    num_output_tokens: int
    sink_tokens: int
    window_tokens: int
    constraint: Constraint
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_output_tokens: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., window_tokens: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class ContinuingRequest(_message.Message):
    __slots__ = ("request_id", "num_scheduled_tokens", "new_page_ids", "dropped_page_indices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_scheduled_tokens: int
    new_page_ids: _containers.RepeatedScalarFieldContainer[int]
    dropped_page_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., num_scheduled_tokens: _Optional[int] = ..., new_page_ids: _Optional[_Iterable[int]] = ..., dropped_page_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class PageCopy(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class PageOps(_message.Message):
    __slots__ = ("swap_out", "swap_in", "copy", "zero")
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    ZERO_FIELD_NUMBER: _ClassVar[int]
    swap_out: _containers.RepeatedCompositeFieldContainer[PageCopy]
    swap_in: _containers.RepeatedCompositeFieldContainer[PageCopy]
    copy: _containers.RepeatedCompositeFieldContainer[PageCopy]
    zero: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, swap_out: _Optional[_Iterable[_Union[PageCopy, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[PageCopy, _Mapping]]] = ..., copy: _Optional[_Iterable[_Union[PageCopy, _Mapping]]] = ..., zero: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "continuing", "forget", "page_ops", "decodes", "adapter_loads")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CONTINUING_FIELD_NUMBER: _ClassVar[int]
    FORGET_FIELD_NUMBER: _ClassVar[int]
    PAGE_OPS_FIELD_NUMBER: _ClassVar[int]
    DECODES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_LOADS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    continuing: _containers.RepeatedCompositeFieldContainer[ContinuingRequest]
    forget: _containers.RepeatedScalarFieldContainer[str]
    page_ops: PageOps
    decodes: _containers.RepeatedScalarFieldContainer[str]
    adapter_loads: _containers.RepeatedCompositeFieldContainer[AdapterLoad]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., continuing: _Optional[_Iterable[_Union[ContinuingRequest, _Mapping]]] = ..., forget: _Optional[_Iterable[str]] = ..., page_ops: _Optional[_Union[PageOps, _Mapping]] = ..., decodes: _Optional[_Iterable[str]] = ..., adapter_loads: _Optional[_Iterable[_Union[AdapterLoad, _Mapping]]] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("page_ops_ms", "forward_ms", "sample_ms", "total_ms", "wait_ms", "prepare_ms", "grammar_wait_ms")
    PAGE_OPS_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_MS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    page_ops_ms: float
    forward_ms: float
    sample_ms: float
    total_ms: float
    wait_ms: float
    prepare_ms: float
    grammar_wait_ms: float
    def __init__(self, page_ops_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ..., sample_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., wait_ms: _Optional[float] = ..., prepare_ms: _Optional[float] = ..., grammar_wait_ms: _Optional[float] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "timings", "error", "desynced_request_ids", "num_computed_tokens", "draining", "sampled_rows", "sampled_token_ids", "sampled_logprobs", "sampled_top_token_ids", "sampled_top_logprobs", "prompt_logprobs", "failed_rows", "failed_errors", "grammar_rows", "grammar_cpu_us")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DESYNCED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_ROWS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FAILED_ROWS_FIELD_NUMBER: _ClassVar[int]
    FAILED_ERRORS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_ROWS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_CPU_US_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    timings: StepTimings
    error: str
    desynced_request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_computed_tokens: int
    draining: bool
    sampled_rows: _containers.RepeatedScalarFieldContainer[int]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_logprobs: _containers.RepeatedScalarFieldContainer[float]
    sampled_top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    failed_rows: _containers.RepeatedScalarFieldContainer[int]
    failed_errors: _containers.RepeatedScalarFieldContainer[str]
    grammar_rows: _containers.RepeatedScalarFieldContainer[int]
    grammar_cpu_us: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., error: _Optional[str] = ..., desynced_request_ids: _Optional[_Iterable[str]] = ..., num_computed_tokens: _Optional[int] = ..., draining: _Optional[bool] = ..., sampled_rows: _Optional[_Iterable[int]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., sampled_logprobs: _Optional[_Iterable[float]] = ..., sampled_top_token_ids: _Optional[_Iterable[int]] = ..., sampled_top_logprobs: _Optional[_Iterable[float]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., failed_rows: _Optional[_Iterable[int]] = ..., failed_errors: _Optional[_Iterable[str]] = ..., grammar_rows: _Optional[_Iterable[int]] = ..., grammar_cpu_us: _Optional[_Iterable[int]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("row", "first_token", "logprobs", "top_token_ids", "top_logprobs", "ranks")
    ROW_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    row: int
    first_token: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, row: _Optional[int] = ..., first_token: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

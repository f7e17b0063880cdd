from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "public")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    public: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., public: _Optional[bool] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "include_stop_str_in_output", "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words", "top_logprobs", "prompt_logprobs", "echo", "constraint")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    include_stop_str_in_output: bool
    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    top_logprobs: int
    prompt_logprobs: int
    echo: bool
    constraint: Constraint
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., echo: _Optional[bool] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "strict")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    strict: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "type", "function")
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: str
    function: FunctionCall
    def __init__(self, id: _Optional[str] = ..., type: _Optional[str] = ..., function: _Optional[_Union[FunctionCall, _Mapping]] = ...) -> None: ...

class FunctionCall(_message.Message):
    __slots__ = ("name", "arguments")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments: str
    def __init__(self, name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "chat_template", "chat_template_kwargs", "continue_final_message", "tools", "tool_choice", "parallel_tool_calls")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    chat_template: str
    chat_template_kwargs: str
    continue_final_message: bool
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., chat_template: _Optional[str] = ..., chat_template_kwargs: _Optional[str] = ..., continue_final_message: _Optional[bool] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("type", "function")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    type: str
    function: FunctionDefinition
    def __init__(self, type: _Optional[str] = ..., function: _Optional[_Union[FunctionDefinition, _Mapping]] = ...) -> None: ...

class FunctionDefinition(_message.Message):
    __slots__ = ("name", "description", "parameters", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    mode: str
    function: str
    def __init__(self, mode: _Optional[str] = ..., function: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "sampling", "request_id", "priority", "page_budget", "continuation", "truncate_prompt_tokens", "retain_kv", "adapter")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PAGE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_KV_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: Chat
    sampling: SamplingParams
    request_id: str
    priority: int
    page_budget: int
    continuation: Continuation
    truncate_prompt_tokens: int
    retain_kv: RetainKv
    adapter: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., priority: _Optional[int] = ..., page_budget: _Optional[int] = ..., continuation: _Optional[_Union[Continuation, _Mapping]] = ..., truncate_prompt_tokens: _Optional[int] = ..., retain_kv: _Optional[_Union[RetainKv, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class RetainKv(_message.Message):
    __slots__ = ("key", "ttl_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    ttl_s: int
    def __init__(self, key: _Optional[str] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("pages_released",)
    PAGES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    pages_released: int
    def __init__(self, pages_released: _Optional[int] = ...) -> None: ...

class Continuation(_message.Message):
    __slots__ = ("forks", "prompt_received")
    FORKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    forks: _containers.RepeatedCompositeFieldContainer[ForkProgress]
    prompt_received: bool
    def __init__(self, forks: _Optional[_Iterable[_Union[ForkProgress, _Mapping]]] = ..., prompt_received: _Optional[bool] = ...) -> None: ...

class ForkProgress(_message.Message):
    __slots__ = ("token_ids", "draw_offset", "finished")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    draw_offset: int
    finished: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., draw_offset: _Optional[int] = ..., finished: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("num_tokens", "token_ids", "text", "logprobs", "top_logprobs", "ranks", "tool_call_format")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    tool_call_format: str
    def __init__(self, num_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., ranks: _Optional[_Iterable[int]] = ..., tool_call_format: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "finish_reason", "stop_reason", "usage", "index", "seed", "top_logprobs", "prompt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    stop_reason: str
    usage: Usage
    index: int
    seed: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    prompt: Prompt
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., index: _Optional[int] = ..., seed: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ("reset_peak",)
    RESET_PEAK_FIELD_NUMBER: _ClassVar[int]
    reset_peak: bool
    def __init__(self, reset_peak: _Optional[bool] = ...) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model", "max_model_len", "block_size", "num_pages", "num_free_pages", "num_used_pages", "vocab_size", "dtype", "attention_backend", "num_running", "num_waiting", "num_preemptions", "peak_used_pages", "num_computed_tokens", "num_cached_prompt_tokens", "num_cached_pages", "prefix_caching", "num_host_pages", "num_used_host_pages", "num_swapped", "num_swap_preemptions", "num_recompute_preemptions", "num_pages_swapped_out", "num_pages_swapped_in", "num_swap_bytes", "num_spilled_pages", "num_spill_hits", "tenant", "executors", "kv_dtype", "kv_bytes_per_token", "cluster_view", "sampling_defaults", "served_model_names", "max_logprobs", "adapters")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PEAK_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPUTE_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_SWAPPED_OUT_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_SWAPPED_IN_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SPILLED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_SPILL_HITS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_VIEW_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    block_size: int
    num_pages: int
    num_free_pages: int
    num_used_pages: int
    vocab_size: int
    dtype: str
    attention_backend: str
    num_running: int
    num_waiting: int
    num_preemptions: int
    peak_used_pages: int
    num_computed_tokens: int
    num_cached_prompt_tokens: int
    num_cached_pages: int
    prefix_caching: bool
    num_host_pages: int
    num_used_host_pages: int
    num_swapped: int
    num_swap_preemptions: int
    num_recompute_preemptions: int
    num_pages_swapped_out: int
    num_pages_swapped_in: int
    num_swap_bytes: int
    num_spilled_pages: int
    num_spill_hits: int
    tenant: TenantInfo
    executors: _containers.RepeatedCompositeFieldContainer[ExecutorInfo]
    kv_dtype: str
    kv_bytes_per_token: int
    cluster_view: bool
    sampling_defaults: SamplingDefaults
    served_model_names: _containers.RepeatedScalarFieldContainer[str]
    max_logprobs: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_used_pages: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., attention_backend: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., peak_used_pages: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_cached_prompt_tokens: _Optional[int] = ..., num_cached_pages: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., num_host_pages: _Optional[int] = ..., num_used_host_pages: _Optional[int] = ..., num_swapped: _Optional[int] = ..., num_swap_preemptions: _Optional[int] = ..., num_recompute_preemptions: _Optional[int] = ..., num_pages_swapped_out: _Optional[int] = ..., num_pages_swapped_in: _Optional[int] = ..., num_swap_bytes: _Optional[int] = ..., num_spilled_pages: _Optional[int] = ..., num_spill_hits: _Optional[int] = ..., tenant: _Optional[_Union[TenantInfo, _Mapping]] = ..., executors: _Optional[_Iterable[_Union[ExecutorInfo, _Mapping]]] = ..., kv_dtype: _Optional[str] = ..., kv_bytes_per_token: _Optional[int] = ..., cluster_view: _Optional[bool] = ..., sampling_defaults: _Optional[_Union[SamplingDefaults, _Mapping]] = ..., served_model_names: _Optional[_Iterable[str]] = ..., max_logprobs: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "rank", "num_bytes", "num_pages", "owner", "resident", "num_page_ins")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGE_INS_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    num_bytes: int
    num_pages: int
    owner: str
    resident: int
    num_page_ins: int
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., num_bytes: _Optional[int] = ..., num_pages: _Optional[int] = ..., owner: _Optional[str] = ..., resident: _Optional[int] = ..., num_page_ins: _Optional[int] = ...) -> None: ...

class SamplingDefaults(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ...) -> None: ...

class ExecutorInfo(_message.Message):
    __slots__ = ("address", "state", "executor_id", "num_pages", "num_used_pages", "num_cached_pages", "num_running", "num_waiting", "num_placed", "num_migrated_out", "num_computed_tokens", "kv_dtype", "kv_bytes_per_token")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_PLACED_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATED_OUT_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: str
    executor_id: str
    num_pages: int
    num_used_pages: int
    num_cached_pages: int
    num_running: int
    num_waiting: int
    num_placed: int
    num_migrated_out: int
    num_computed_tokens: int
    kv_dtype: str
    kv_bytes_per_token: int
    def __init__(self, address: _Optional[str] = ..., state: _Optional[str] = ..., executor_id: _Optional[str] = ..., num_pages: _Optional[int] = ..., num_used_pages: _Optional[int] = ..., num_cached_pages: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_placed: _Optional[int] = ..., num_migrated_out: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., kv_bytes_per_token: _Optional[int] = ...) -> None: ...

class TenantInfo(_message.Message):
    __slots__ = ("id", "weight", "page_quota", "reserved_pages", "max_concurrent_requests", "page_budget", "overflow", "used_pages", "peak_used_pages", "num_running", "num_waiting", "num_swapped", "service", "budget_hits", "fair_share_preemptions", "fair_share_pages", "sliding_window", "sink_tokens", "max_queued_requests", "structured_outputs", "max_constraint_bytes", "max_constrained_requests", "grammar_cpu_seconds", "retained_pages", "max_retained_pages")
    ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PAGE_QUOTA_FIELD_NUMBER: _ClassVar[int]
    RESERVED_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PEAK_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_HITS_FIELD_NUMBER: _ClassVar[int]
    FAIR_SHARE_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    FAIR_SHARE_PAGES_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONSTRAINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONSTRAINED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RETAINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_RETAINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    id: str
    weight: float
    page_quota: int
    reserved_pages: int
    max_concurrent_requests: int
    page_budget: int
    overflow: str
    used_pages: int
    peak_used_pages: int
    num_running: int
    num_waiting: int
    num_swapped: int
    service: float
    budget_hits: int
    fair_share_preemptions: int
    fair_share_pages: float
    sliding_window: int
    sink_tokens: int
    max_queued_requests: int
    structured_outputs: bool
    max_constraint_bytes: int
    max_constrained_requests: int
    grammar_cpu_seconds: float
    retained_pages: int
    max_retained_pages: int
    def __init__(self, id: _Optional[str] = ..., weight: _Optional[float] = ..., page_quota: _Optional[int] = ..., reserved_pages: _Optional[int] = ..., max_concurrent_requests: _Optional[int] = ..., page_budget: _Optional[int] = ..., overflow: _Optional[str] = ..., used_pages: _Optional[int] = ..., peak_used_pages: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_swapped: _Optional[int] = ..., service: _Optional[float] = ..., budget_hits: _Optional[int] = ..., fair_share_preemptions: _Optional[int] = ..., fair_share_pages: _Optional[float] = ..., sliding_window: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., structured_outputs: _Optional[bool] = ..., max_constraint_bytes: _Optional[int] = ..., max_constrained_requests: _Optional[int] = ..., grammar_cpu_seconds: _Optional[float] = ..., retained_pages: _Optional[int] = ..., max_retained_pages: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens", "chat")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    chat: Chat
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

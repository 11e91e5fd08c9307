from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SchedulingPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULING_POLICY_UNSPECIFIED: _ClassVar[SchedulingPolicy]
    SCHEDULING_POLICY_STATIC: _ClassVar[SchedulingPolicy]
    SCHEDULING_POLICY_QUEUE: _ClassVar[SchedulingPolicy]
    SCHEDULING_POLICY_LONGEST_FIRST: _ClassVar[SchedulingPolicy]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class ControlOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTROL_OP_UNSPECIFIED: _ClassVar[ControlOp]
    CONTROL_OP_INIT_WEIGHT_TRANSFER: _ClassVar[ControlOp]
    CONTROL_OP_START_WEIGHT_UPDATE: _ClassVar[ControlOp]
    CONTROL_OP_UPDATE_WEIGHTS: _ClassVar[ControlOp]
    CONTROL_OP_FINISH_WEIGHT_UPDATE: _ClassVar[ControlOp]
    CONTROL_OP_RESET_PREFIX_CACHE: _ClassVar[ControlOp]
    CONTROL_OP_SLEEP: _ClassVar[ControlOp]
    CONTROL_OP_WAKE_UP: _ClassVar[ControlOp]
    CONTROL_OP_ABORT_WEIGHT_UPDATE: _ClassVar[ControlOp]
    CONTROL_OP_LOAD_LORA_ADAPTER: _ClassVar[ControlOp]
    CONTROL_OP_UNLOAD_LORA_ADAPTER: _ClassVar[ControlOp]
SCHEDULING_POLICY_UNSPECIFIED: SchedulingPolicy
SCHEDULING_POLICY_STATIC: SchedulingPolicy
SCHEDULING_POLICY_QUEUE: SchedulingPolicy
SCHEDULING_POLICY_LONGEST_FIRST: SchedulingPolicy
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
CONTROL_OP_UNSPECIFIED: ControlOp
CONTROL_OP_INIT_WEIGHT_TRANSFER: ControlOp
CONTROL_OP_START_WEIGHT_UPDATE: ControlOp
CONTROL_OP_UPDATE_WEIGHTS: ControlOp
CONTROL_OP_FINISH_WEIGHT_UPDATE: ControlOp
CONTROL_OP_RESET_PREFIX_CACHE: ControlOp
CONTROL_OP_SLEEP: ControlOp
CONTROL_OP_WAKE_UP: ControlOp
CONTROL_OP_ABORT_WEIGHT_UPDATE: ControlOp
CONTROL_OP_LOAD_LORA_ADAPTER: ControlOp
CONTROL_OP_UNLOAD_LORA_ADAPTER: ControlOp

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("prompt_id", "text", "token_ids", "max_tokens")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    text: str
    token_ids: TokenIds
    max_tokens: int
    def __init__(self, prompt_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids", "seed", "n", "ignore_eos", "logprobs_mode", "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "logprobs", "prompt_logprobs", "cache_salt")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    n: int
    ignore_eos: bool
    logprobs_mode: str
    min_tokens: int
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    logprobs: int
    prompt_logprobs: int
    cache_salt: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., logprobs_mode: _Optional[str] = ..., min_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class SourceStats(_message.Message):
    __slots__ = ("source", "drafted_tokens", "accepted_tokens")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    source: str
    drafted_tokens: int
    accepted_tokens: int
    def __init__(self, source: _Optional[str] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class Provenance(_message.Message):
    __slots__ = ("forward_passes", "sources")
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    forward_passes: int
    sources: _containers.RepeatedCompositeFieldContainer[SourceStats]
    def __init__(self, forward_passes: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[SourceStats, _Mapping]]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "token", "top_token_ids", "top_logprobs", "top_tokens")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    token: str
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., token: _Optional[str] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., top_tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("step_id", "prompt_id", "sample_index", "token_ids", "logprobs", "text", "finish_reason", "policy_version", "worker_id", "provenance", "prompt_tokens", "stop_string", "stop_token_id", "top_logprobs", "version_spans", "prompt_logprobs", "adapter", "adapter_version")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROVENANCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    prompt_id: str
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    finish_reason: FinishReason
    policy_version: int
    worker_id: str
    provenance: Provenance
    prompt_tokens: int
    stop_string: str
    stop_token_id: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprob]
    adapter: str
    adapter_version: int
    def __init__(self, step_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., policy_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., provenance: _Optional[_Union[Provenance, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprob, _Mapping]]] = ..., adapter: _Optional[str] = ..., adapter_version: _Optional[int] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("start", "policy_version")
    START_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    start: int
    policy_version: int
    def __init__(self, start: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("step_id", "policy_version", "prompts", "sampling", "lookahead", "policy", "disable_drafts", "disable_straggler_watch", "batch_completions")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DISABLE_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_STRAGGLER_WATCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    policy_version: int
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    lookahead: _containers.RepeatedCompositeFieldContainer[Prompt]
    policy: SchedulingPolicy
    disable_drafts: bool
    disable_straggler_watch: bool
    batch_completions: bool
    def __init__(self, step_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., lookahead: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., policy: _Optional[_Union[SchedulingPolicy, str]] = ..., disable_drafts: _Optional[bool] = ..., disable_straggler_watch: _Optional[bool] = ..., batch_completions: _Optional[bool] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("prompts", "sampling", "disable_drafts", "single_version")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DISABLE_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SINGLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    disable_drafts: bool
    single_version: bool
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., disable_drafts: _Optional[bool] = ..., single_version: _Optional[bool] = ...) -> None: ...

class StepSummary(_message.Message):
    __slots__ = ("step_id", "policy_version", "completions", "makespan_seconds", "generated_tokens", "provenance", "busy_worker_seconds", "idle_worker_seconds", "drafting_worker_seconds", "requests_moved", "requests_requeued")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    MAKESPAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROVENANCE_FIELD_NUMBER: _ClassVar[int]
    BUSY_WORKER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_WORKER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTING_WORKER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REQUEUED_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    policy_version: int
    completions: int
    makespan_seconds: float
    generated_tokens: int
    provenance: Provenance
    busy_worker_seconds: float
    idle_worker_seconds: float
    drafting_worker_seconds: float
    requests_moved: int
    requests_requeued: int
    def __init__(self, step_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., completions: _Optional[int] = ..., makespan_seconds: _Optional[float] = ..., generated_tokens: _Optional[int] = ..., provenance: _Optional[_Union[Provenance, _Mapping]] = ..., busy_worker_seconds: _Optional[float] = ..., idle_worker_seconds: _Optional[float] = ..., drafting_worker_seconds: _Optional[float] = ..., requests_moved: _Optional[int] = ..., requests_requeued: _Optional[int] = ...) -> None: ...

class CompletionBatch(_message.Message):
    __slots__ = ("completions",)
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completion", "summary", "completions")
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completion: Completion
    summary: StepSummary
    completions: CompletionBatch
    def __init__(self, completion: _Optional[_Union[Completion, _Mapping]] = ..., summary: _Optional[_Union[StepSummary, _Mapping]] = ..., completions: _Optional[_Union[CompletionBatch, _Mapping]] = ...) -> None: ...

class AnnounceRequest(_message.Message):
    __slots__ = ("prompts", "sampling")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class AnnounceResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class UpdatePolicyRequest(_message.Message):
    __slots__ = ("version", "weights_path")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    version: int
    weights_path: str
    def __init__(self, version: _Optional[int] = ..., weights_path: _Optional[str] = ...) -> None: ...

class UpdatePolicyResponse(_message.Message):
    __slots__ = ("version", "workers_loaded")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_LOADED_FIELD_NUMBER: _ClassVar[int]
    version: int
    workers_loaded: int
    def __init__(self, version: _Optional[int] = ..., workers_loaded: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "state", "policy_version", "running", "capacity", "tokens_per_second")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    state: str
    policy_version: int
    running: int
    capacity: int
    tokens_per_second: float
    def __init__(self, worker_id: _Optional[str] = ..., state: _Optional[str] = ..., policy_version: _Optional[int] = ..., running: _Optional[int] = ..., capacity: _Optional[int] = ..., tokens_per_second: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("policy_version", "workers", "steps", "requests_waiting", "requests_running", "json")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    steps: _containers.RepeatedCompositeFieldContainer[StepSummary]
    requests_waiting: int
    requests_running: int
    json: str
    def __init__(self, policy_version: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., steps: _Optional[_Iterable[_Union[StepSummary, _Mapping]]] = ..., requests_waiting: _Optional[int] = ..., requests_running: _Optional[int] = ..., json: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("step_id",)
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    def __init__(self, step_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled_requests",)
    CANCELLED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    cancelled_requests: int
    def __init__(self, cancelled_requests: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("worker_id", "capacity", "policy_version", "max_model_len", "vocab_size", "model", "speculation", "logprobs_mode", "tensor_parallel_size", "accepts_assign_batches", "accepts_resume", "dtype", "lora_config")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_ASSIGN_BATCHES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_RESUME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    capacity: int
    policy_version: int
    max_model_len: int
    vocab_size: int
    model: str
    speculation: bool
    logprobs_mode: str
    tensor_parallel_size: int
    accepts_assign_batches: bool
    accepts_resume: bool
    dtype: str
    lora_config: str
    def __init__(self, worker_id: _Optional[str] = ..., capacity: _Optional[int] = ..., policy_version: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., model: _Optional[str] = ..., speculation: _Optional[bool] = ..., logprobs_mode: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., accepts_assign_batches: _Optional[bool] = ..., accepts_resume: _Optional[bool] = ..., dtype: _Optional[str] = ..., lora_config: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("running", "tokens_per_second")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    running: int
    tokens_per_second: float
    def __init__(self, running: _Optional[int] = ..., tokens_per_second: _Optional[float] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("request_key", "generated_tokens")
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_key: str
    generated_tokens: int
    def __init__(self, request_key: _Optional[str] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class WorkerCompletion(_message.Message):
    __slots__ = ("request_key", "completion")
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    request_key: str
    completion: Completion
    def __init__(self, request_key: _Optional[str] = ..., completion: _Optional[_Union[Completion, _Mapping]] = ...) -> None: ...

class ProgressBatch(_message.Message):
    __slots__ = ("progress",)
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    progress: _containers.RepeatedCompositeFieldContainer[Progress]
    def __init__(self, progress: _Optional[_Iterable[_Union[Progress, _Mapping]]] = ...) -> None: ...

class WorkerCompletionBatch(_message.Message):
    __slots__ = ("completions",)
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[WorkerCompletion]
    def __init__(self, completions: _Optional[_Iterable[_Union[WorkerCompletion, _Mapping]]] = ...) -> None: ...

class Aborted(_message.Message):
    __slots__ = ("request_key", "reason", "partial")
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    request_key: str
    reason: str
    partial: Completion
    def __init__(self, request_key: _Optional[str] = ..., reason: _Optional[str] = ..., partial: _Optional[_Union[Completion, _Mapping]] = ...) -> None: ...

class PolicyLoaded(_message.Message):
    __slots__ = ("version", "ok", "error", "seconds", "weights_unknown")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    version: int
    ok: bool
    error: str
    seconds: float
    weights_unknown: bool
    def __init__(self, version: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ..., weights_unknown: _Optional[bool] = ...) -> None: ...

class DraftResult(_message.Message):
    __slots__ = ("job_id", "tokens", "finished")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    tokens: int
    finished: bool
    def __init__(self, job_id: _Optional[str] = ..., tokens: _Optional[int] = ..., finished: _Optional[bool] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "heartbeat", "progress", "completion", "aborted", "policy_loaded", "draft_result", "control_result", "completions", "progress_batch")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    POLICY_LOADED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_RESULT_FIELD_NUMBER: _ClassVar[int]
    CONTROL_RESULT_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_BATCH_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    heartbeat: Heartbeat
    progress: Progress
    completion: WorkerCompletion
    aborted: Aborted
    policy_loaded: PolicyLoaded
    draft_result: DraftResult
    control_result: ControlResult
    completions: WorkerCompletionBatch
    progress_batch: ProgressBatch
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., completion: _Optional[_Union[WorkerCompletion, _Mapping]] = ..., aborted: _Optional[_Union[Aborted, _Mapping]] = ..., policy_loaded: _Optional[_Union[PolicyLoaded, _Mapping]] = ..., draft_result: _Optional[_Union[DraftResult, _Mapping]] = ..., control_result: _Optional[_Union[ControlResult, _Mapping]] = ..., completions: _Optional[_Union[WorkerCompletionBatch, _Mapping]] = ..., progress_batch: _Optional[_Union[ProgressBatch, _Mapping]] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("request_key", "step_id", "prompt_id", "sample_index", "prompt_token_ids", "sampling", "policy_version", "use_drafts", "group_size", "predicted_tokens", "resume", "adapter", "adapter_version")
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    USE_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_key: str
    step_id: str
    prompt_id: str
    sample_index: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    policy_version: int
    use_drafts: bool
    group_size: int
    predicted_tokens: float
    resume: Completion
    adapter: str
    adapter_version: int
    def __init__(self, request_key: _Optional[str] = ..., step_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., policy_version: _Optional[int] = ..., use_drafts: _Optional[bool] = ..., group_size: _Optional[int] = ..., predicted_tokens: _Optional[float] = ..., resume: _Optional[_Union[Completion, _Mapping]] = ..., adapter: _Optional[str] = ..., adapter_version: _Optional[int] = ...) -> None: ...

class AssignBatch(_message.Message):
    __slots__ = ("assignments",)
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    assignments: _containers.RepeatedCompositeFieldContainer[Assignment]
    def __init__(self, assignments: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("request_key", "keep_partial")
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    KEEP_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    request_key: str
    keep_partial: bool
    def __init__(self, request_key: _Optional[str] = ..., keep_partial: _Optional[bool] = ...) -> None: ...

class LoadPolicy(_message.Message):
    __slots__ = ("version", "weights_path")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    version: int
    weights_path: str
    def __init__(self, version: _Optional[int] = ..., weights_path: _Optional[str] = ...) -> None: ...

class DraftJob(_message.Message):
    __slots__ = ("job_id", "step_id", "prompt_token_ids", "sampling", "policy_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    policy_version: int
    def __init__(self, job_id: _Optional[str] = ..., step_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class StopDraft(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ControlCall(_message.Message):
    __slots__ = ("call_id", "op", "json", "policy_version")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    op: ControlOp
    json: str
    policy_version: int
    def __init__(self, call_id: _Optional[str] = ..., op: _Optional[_Union[ControlOp, str]] = ..., json: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class ControlResult(_message.Message):
    __slots__ = ("call_id", "ok", "error", "json")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    ok: bool
    error: str
    json: str
    def __init__(self, call_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., json: _Optional[str] = ...) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("assign", "abort", "load_policy", "draft_job", "stop_draft", "control", "assigns")
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    LOAD_POLICY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_JOB_FIELD_NUMBER: _ClassVar[int]
    STOP_DRAFT_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    ASSIGNS_FIELD_NUMBER: _ClassVar[int]
    assign: Assignment
    abort: Abort
    load_policy: LoadPolicy
    draft_job: DraftJob
    stop_draft: StopDraft
    control: ControlCall
    assigns: AssignBatch
    def __init__(self, assign: _Optional[_Union[Assignment, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., load_policy: _Optional[_Union[LoadPolicy, _Mapping]] = ..., draft_job: _Optional[_Union[DraftJob, _Mapping]] = ..., stop_draft: _Optional[_Union[StopDraft, _Mapping]] = ..., control: _Optional[_Union[ControlCall, _Mapping]] = ..., assigns: _Optional[_Union[AssignBatch, _Mapping]] = ...) -> None: ...

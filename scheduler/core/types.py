"""Data the scheduler core takes in and the actions it gives back (frozen dataclasses).

The core never does I/O: the shell feeds it events (a worker said hello, a completion
arrived, a tick) and executes the actions it returns (send this assignment, deliver this
completion, ...).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from bubblespec.common.types import Completion, SamplingParams, SchedulingPolicy, StepSummary

__all__ = [
    "Abort",
    "Action",
    "Assign",
    "Deliver",
    "Disconnect",
    "DraftJobSpec",
    "ErrorCode",
    "Ignored",
    "InvalidRequest",
    "LoadPolicy",
    "ModelLimits",
    "PolicyFailed",
    "PolicyLoadReported",
    "PolicyReady",
    "PromptSpec",
    "RequestFailed",
    "RequestSpec",
    "RequestsMoved",
    "StartDraft",
    "StepFailed",
    "StepFinished",
    "StepSpec",
    "StopDraft",
    "WorkerHello",
    "WorkerStatus",
    "request_key",
    "step_of",
]


class ErrorCode(enum.StrEnum):
    """gRPC status names the core refuses with (``InvalidRequest.code``); each is its name as
    a string, so ``grpc.StatusCode[code]`` and JSON bodies are unchanged."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    CANCELLED = "CANCELLED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    INTERNAL = "INTERNAL"


class WorkerStatus(enum.StrEnum):
    """What a worker is doing, as ``/status``, the UI and the timeline segments name it."""

    IDLE = "idle"
    BUSY = "busy"
    DRAFTING = "drafting"
    LOADING = "loading"


def request_key(step_id: str, prompt_id: str, sample_index: int) -> str:
    """The key of one request (one sample of one prompt of one step)."""
    return f"{step_id}/{prompt_id}/{sample_index}"


def step_of(key: str) -> str:
    """The step id a request key belongs to."""
    return key.split("/", 1)[0]


class InvalidRequest(ValueError):
    """A request the core refuses. ``field`` names the offending field; ``code`` is a gRPC
    status name (INVALID_ARGUMENT, FAILED_PRECONDITION, ALREADY_EXISTS, UNAVAILABLE, ...)."""

    def __init__(self, field: str, message: str, code: str = ErrorCode.INVALID_ARGUMENT,
                 retry_after: float | None = None):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        """What is wrong with the field (``str(exc)`` is ``field: message``)."""
        self.code = code
        self.retry_after = retry_after
        """Seconds after which the same call may succeed (a full queue: HTTP 429 ``Retry-After``)."""


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class WorkerHello:
    worker_id: str
    capacity: int
    policy_version: int
    limits: ModelLimits
    speculation: bool = False
    logprobs_mode: str = "processed"
    """The logprobs its engine returns: it runs only requests asking for these."""
    tensor_parallel_size: int = 1
    """Ranks of its engine (GPUs of its tensor-parallel group): its share of a weight-transfer group."""
    model: str = ""
    """The weights its engine started from (a directory on the worker's machine; '' = not said):
    the base weights that ``POST /reload_weights`` goes back to."""
    accepts_resume: bool = False
    """It can stop a request and send what it generated (``Abort.keep_partial``) and continue a
    request from such a partial (``Assign.resume``): the core moves long requests only between
    such workers (``core/moves.py``)."""
    dtype: str = ""
    """The dtype its engine runs the model in (``bfloat16``; '' = not said): ``/server_info``'s."""


@dataclass(frozen=True)
class PromptSpec:
    prompt_id: str
    token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class StepSpec:
    """A validated step. ``fingerprint`` identifies its content (for idempotent resume)."""

    step_id: str
    policy_version: int
    prompts: tuple[PromptSpec, ...]
    sampling: SamplingParams
    lookahead: tuple[tuple[int, ...], ...] = ()
    policy: SchedulingPolicy = SchedulingPolicy.QUEUE
    use_drafts: bool = True
    straggler_watch: bool = True
    fingerprint: str = ""
    adapter: tuple[str, int] | None = None
    """Pool calls: the LoRA adapter (name, version) its requests run with (``core/adapters.py``);
    None: the base model."""

    @property
    def num_requests(self) -> int:
        return len(self.prompts) * self.sampling.n


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One (prompt, sample) of a step: the unit of dispatch. Slots: a step makes one per request
    (8,192 per step in the load test), 48 bytes smaller and quicker to make without a ``__dict__``."""

    key: str
    step_id: str
    prompt_id: str
    sample_index: int
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams  # n = 1, seed offset by sample_index, per-prompt max_tokens
    policy_version: int
    use_drafts: bool
    group_size: int
    adapter: tuple[str, int] | None = None
    """The LoRA adapter (name, version) it runs with (``core/adapters.py``); None: the base model."""


@dataclass(frozen=True)
class DraftJobSpec:
    """Generate a draft response for an upcoming prompt under the current policy."""

    job_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    policy_version: int
    for_step: str = ""


# ------------------------------------------------------------------ actions --


@dataclass(frozen=True)
class Assign:
    worker_id: str
    request: RequestSpec
    predicted_tokens: float = 0.0
    """The core's predicted response length for the request (0: none), for the worker's draft
    plan (``worker/tail_drafts.py``)."""
    resume: Completion | None = None
    """What the request generated on the worker it moved off (``core/moves.py``): the worker
    continues from it, and its completion holds these tokens and what follows them."""


@dataclass(frozen=True)
class Abort:
    worker_id: str
    key: str
    keep_partial: bool = False
    """Answer with what the request generated so far (``Aborted.partial``): the core moves it."""


@dataclass(frozen=True)
class LoadPolicy:
    worker_id: str
    version: int
    weights_path: str


@dataclass(frozen=True)
class StartDraft:
    worker_id: str
    job: DraftJobSpec


@dataclass(frozen=True)
class StopDraft:
    worker_id: str
    job_id: str


@dataclass(frozen=True)
class ControlCall:
    """An engine control call for one worker (weight transfer, LoRA adapters, sleep, the prefix
    cache: ``scheduler/control.py`` fans them out and awaits the answers). Like the actions for a
    worker, it is what the worker's outbox holds; ``scheduler/wire.py`` turns it into the
    stream's message."""

    worker_id: str
    call_id: str
    """Echoed in the worker's answer."""
    op: str
    """The operation: ``ControlOp`` of ``rollout.proto`` without its ``CONTROL_OP_`` prefix, in
    lower case (``init_weight_transfer``, ``sleep``, ``load_lora_adapter``, ...)."""
    arguments: str
    """Its arguments, a JSON object."""
    policy_version: int = 0
    """``finish_weight_update``: the version the new weights serve as."""


@dataclass(frozen=True)
class Disconnect:
    """Close a worker's stream (declared dead); it may reconnect and say hello again."""

    worker_id: str
    reason: str


@dataclass(frozen=True)
class Deliver:
    step_id: str
    completion: Completion


@dataclass(frozen=True)
class RequestFailed:
    """A request of the pool (``core/pool.py``) failed every attempt: its caller gets the error."""

    key: str
    field: str
    message: str
    code: ErrorCode = ErrorCode.INTERNAL
    """The caller's error: ``UNAVAILABLE`` where no worker was left to run it (``core/liveness.py``)."""


@dataclass(frozen=True)
class StepFinished:
    step_id: str
    summary: StepSummary


@dataclass(frozen=True)
class StepFailed:
    """A step ended without a result: one of its requests failed ``max_attempts`` times
    (``CoreSettings.max_attempts``), or no worker was connected for longer than
    ``CoreSettings.no_worker_timeout_seconds`` (``core/liveness.py``). ``field`` names the prompt
    ("prompts[3]"; ``workers`` for the latter); ``message`` names its prompt id, the sample, the
    workers tried and the last worker's reason (or how long no worker was connected)."""

    step_id: str
    field: str
    message: str
    code: ErrorCode = ErrorCode.FAILED_PRECONDITION
    """The trainer's error: ``UNAVAILABLE`` for want of workers (a retry runs the step again)."""


@dataclass(frozen=True)
class PolicyReady:
    version: int
    workers: int


@dataclass(frozen=True)
class PolicyFailed:
    """A policy update did not load on every live worker; the cluster stays at its previous
    version. ``code`` is a gRPC status name, ``field`` the request field the message names."""

    version: int
    code: ErrorCode
    field: str
    message: str


@dataclass(frozen=True)
class RequestsMoved:
    """Requests of ``step_id`` put back on the step's shared queue for another worker. Not
    ``requeued``: the straggler watch took them off a slow worker or a stalled run (one
    intervention; the summary's ``requests_moved``). ``requeued``: their worker left, could
    not run them, was paused off them, or answered with another policy version
    (``requests_requeued``)."""

    step_id: str
    keys: tuple[str, ...]
    requeued: bool = False
    resumed: bool = False
    """A long request an idle worker took over, going on from what it generated (``core/moves.py``)."""


@dataclass(frozen=True)
class PolicyLoadReported:
    """A worker answered the ``LoadPolicy`` it was asked (``seconds``: how long it took);
    reported before the barrier's outcome, for logs and metrics."""

    worker_id: str
    version: int
    ok: bool
    error: str
    seconds: float


@dataclass(frozen=True)
class Ignored:
    """A worker event the core did not take (stale: the request moved or was cancelled; or
    forged): ``field`` names what it referred to. Nothing changed; the shell logs it."""

    worker_id: str
    field: str
    reason: str


Action = (Assign | Abort | LoadPolicy | StartDraft | StopDraft | Deliver | StepFinished | StepFailed | PolicyReady
          | PolicyFailed | Disconnect | RequestsMoved | PolicyLoadReported | Ignored | RequestFailed)


@dataclass
class Timeline:
    """Busy / idle / drafting seconds of one worker, plus recent segments for the UI."""

    busy: float = 0.0
    idle: float = 0.0
    drafting: float = 0.0
    segments: list[tuple[str, float, float]] = field(default_factory=list)

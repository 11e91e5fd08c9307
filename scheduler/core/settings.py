"""``CoreSettings``: the tunables of the scheduling core (one frozen dataclass, every field with
a default and a docstring).

The measurements behind the defaults (simulator and real-bench ratios, pass costs) are in
docs/SIMULATOR.md and docs/BENCHMARKS.md, which the docstrings below name.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CoreSettings"]


@dataclass(frozen=True)
class CoreSettings:
    """Tunables of the scheduling core."""

    worker_timeout_seconds: float = 10.0
    """A worker silent for this long is declared dead; its work is re-queued."""
    no_worker_timeout_seconds: float | None = 60.0
    """Once no worker has been connected for this long (every engine gone), running steps and
    queued calls fail UNAVAILABLE (HTTP 503) naming the cause, and new ones are refused so until
    a worker connects (``core/liveness.py``); a worker restarting within it loses no call. None:
    wait for a worker forever."""
    straggler_ratio: float = 0.5
    """A worker slower than this share of the median throughput is a straggler."""
    straggler_grace_seconds: float = 2.0
    """A worker is not judged before it has been busy this long in the step."""
    stall_seconds: float = 30.0
    """A running request with no progress for this long is moved to another worker."""
    keep_steps: int = 4
    """Finished steps kept in memory (resume after a scheduler restart uses the Redis journal)."""
    max_length_history: int = 200_000
    """Prompts whose response-length average is kept (oldest forgotten first; ~100 bytes each,
    whatever the prompt's length: the history keys by a hash of the prompt)."""
    drafting: bool = True
    """Send idle workers draft jobs for upcoming prompts."""
    max_draft_jobs_per_worker: int = 16
    """Draft jobs one idle worker runs at once (spreads drafting over the idle workers)."""
    max_draft_jobs_during_step: int | None = None
    """The same while a step runs (None = ``max_draft_jobs_per_worker``; 0 = none until the step
    ends). Lower where workers share host CPUs: there an idle worker's drafting takes CPU the
    busy workers' engines use, and slows the step's tail more than its drafts save."""
    max_draft_jobs_beside_requests: int = 4
    """Draft jobs a worker keeps running beside its requests, for the upcoming prompts predicted
    longest (0: a worker drafts only while it has no request). Bubbles are short where a step
    is balanced, so drafting only in them leaves the next step's long responses with partial
    drafts; beside the requests a job runs through the whole step, at the cost of one more
    sequence in the batch (cheap where a pass is memory-bound). A job never takes a request's
    slot: a request for a full worker stops the least valuable job first. Only while future
    drafts pay: in recent completions that were offered future draft tokens, accepted ones made
    at least ``BESIDE_MIN_SAVING`` of the tokens (a worker proposes none where a draft token
    costs more than it is expected to save, and few where it pays only at a step's tail), and
    in the first step, before any evidence (``draft_beside_first_step``). And
    only while the trainer's gaps are short: where the last gap between steps lasted at least as
    long as the last step, the idle workers draft in it what a step's worth of passes can (a
    draft needs as many passes as its response has tokens, and a step lasts about as many
    passes as its longest response), and jobs beside requests would only slow the step."""
    min_requests_beside_draft_jobs: int = 0
    """No draft job starts beside fewer requests than this on a worker (0: at any count). A
    job is one more sequence in every pass: beside a full batch a small share of the pass,
    beside the few requests a worker holds at its tail a larger one, and those requests are
    what the step's end waits for. The real bench gained more from the jobs beside the tail
    (they make the next step's drafts, whose acceptance there is far above the simulator's
    assumed 0.7) than the simulator lost to them, hence 0 by default; raise it where acceptance
    is lower (measurements: docs/SIMULATOR.md)."""
    draft_beside_first_step: bool = True
    """Run draft jobs beside the first step's requests, before any completion can show whether
    future drafts pay (none can exist before that step; the jobs beside its requests are what
    drafts the next step in full). After the first step the evidence decides
    (``max_draft_jobs_beside_requests``). Off: none until the evidence shows drafts paying, for
    engines where a draft token is known to cost more than it saves (the simulator's
    compute-bound profile ran its first step slower with it on; docs/SIMULATOR.md)."""
    spread_samples: bool = False
    """Hand out a step's shared queue one request at a time, so that a prompt's samples (whose
    lengths go together) spread over the workers, as Seer does; off: one sample group at a
    time, so that a worker has its prompt's other samples running beside a request, to draft
    from (source ``sibling``). It paid in the simulator (homogeneous workers, no sibling
    drafts) and lost in the real bench, where two engines share two cores with the control
    process (docs/BENCHMARKS.md, docs/SIMULATOR.md). Hence off by default; on where each worker
    has its own CPUs."""
    min_requests_beside_draft_jobs_at_tail: int = 0
    """At a step's tail, no draft job starts beside fewer requests than this on a worker (0, the
    default: the same as before the tail). The tail begins when the first worker that can draft has none of
    the step's work left; then every worker with fewer requests stops the jobs beside them (their
    prompts go back to the planner with their partial drafts, and the idle worker that began the
    tail drafts them). Such a worker runs what the step's end waits for, in passes its few
    requests leave cheap, and each job is one more sequence in every one of them, while an idle
    worker drafts the same prompts at no cost to the step. Workers with fuller batches keep their
    jobs: there a job is a small share of the pass, and where idle workers are few their drafting
    is most of the next step's drafts. A job already running when a worker's requests fall below
    it later runs on (stopping it too made the simulator slower: its prompt restarts elsewhere,
    with a prefill and its partial draft verified again). 3 paid in the simulator at 64 and 512
    workers and not in the real bench on two workers, where the idle one's drafting is already
    full. Hence 0 by default; 3 where idle workers are many (docs/SIMULATOR.md, docs/BENCHMARKS.md)."""
    move_long_requests: bool = True
    """A worker that runs out of work (or nearly: ``move_to_workers_running_at_most``) takes over
    the running request with the most tokens so far from the worker with the fullest batch, and
    goes on from what it generated (``core/moves.py``);
    only between workers that can (``WorkerHello.accepts_resume``: the vLLM worker, the
    simulator's). Measured in docs/SIMULATOR.md and docs/BENCHMARKS.md (the real bench's
    responses are short: few requests move there)."""
    min_tokens_to_move: int = 256
    """A request moves only once it has generated this many tokens (short ones end before a
    move would pay for its prefill)."""
    move_to_workers_running_at_most: int = 8
    """With ``move_long_requests``, in a step without drafts, a worker running at most this many
    requests and no draft job (not only one that ran out of work) takes over a long request from
    a batch of at least twice its own and two more (``core/moves.py``). Every pass costs a part
    per sequence, so at a step's tail the longest requests end sooner spread over lightly loaded
    workers than crowded in one batch, and which of a group's same-aged samples is the longest
    cannot be told, so moving one at a time to idle workers often moves the wrong one first.
    Drafted steps keep the rule before: letting their requests move too stopped the draft jobs
    of the workers that took them (none runs beside a moved request) and lost in the simulator.
    0: only a worker with nothing to run (measurements: docs/SIMULATOR.md)."""
    timeline_segments: int = 256
    """Timeline segments kept per worker (for the UI)."""
    max_active_steps: int = 16
    """Steps running at once; a Generate for a new step beyond it is refused with
    RESOURCE_EXHAUSTED naming ``step_id`` (a resumed step is not new). Global: trainers share
    the trainer token, so the scheduler cannot tell one from another."""
    max_pending_requests: int = 65_536
    """Requests of independent calls (the pool, ``core/pool.py``) waiting or running at once; a
    call that would leave more is refused RESOURCE_EXHAUSTED with a retry hint (HTTP 429 with
    ``Retry-After``), and adds nothing. Calls are not capped otherwise: each is answered as it
    finishes."""
    max_pending_prompt_tokens: int = 2**25
    """Prompt tokens of the pool's requests waiting or running at once (the pool's memory: about
    8 bytes a token); beyond it, refused as for ``max_pending_requests``."""
    session_affinity: bool = True
    """Send a conversation's next turn (same ``X-Session-ID``, or a prompt that extends an
    earlier request's prompt and response) to the worker that ran the last one while that
    worker has room: its prefix is in that worker's KV cache (``core/affinity.py``)."""
    max_announced_prompts: int = 131_072
    """Announced prompts (Announce, and Generate's lookahead) waiting in the draft planner for
    their step. An Announce or Generate that would leave more is refused with
    RESOURCE_EXHAUSTED naming ``prompts`` / ``lookahead``, and announces nothing. Global, like
    ``max_active_steps``."""
    max_attempts: int = 3
    """Failed attempts of one request before its step fails (``StepFailed``). A failed attempt
    is a request taken back from a worker that was running it: the worker reported it aborted
    (its engine errored or refused it), the worker's stream ended or it fell silent while
    running it, or it made no progress for ``stall_seconds``. Queued work moved off a
    straggler, or never started on a worker that left, is not an attempt. Without a cap, a
    request that breaks every worker (or its stream) would go round them forever."""

    def __post_init__(self) -> None:
        for name in ("max_draft_jobs_per_worker", "max_draft_jobs_beside_requests", "min_requests_beside_draft_jobs",
                     "min_requests_beside_draft_jobs_at_tail", "min_tokens_to_move", "move_to_workers_running_at_most"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be a whole number >= 0, got {value!r:.40}")
        timeout = self.no_worker_timeout_seconds
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                    or not timeout > 0 or timeout == float("inf")):
            raise ValueError(f"no_worker_timeout_seconds: must be a finite number > 0 or None, got {timeout!r:.40}")

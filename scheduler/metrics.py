"""Prometheus exporter of the scheduler: the core produces stats, this turns them into metrics.

Three inputs, one registry per ``Scheduler`` (never the global one: tests run several
schedulers in one process):

- ``SchedulerMetrics.on_action`` listens on ``SchedulerService.listeners`` and counts what the
  core decides as it happens: completions, generated tokens, forward passes, draft and
  accepted tokens by source, step makespans, moved and re-queued requests, straggler
  interventions.
- At scrape time the exporter reads the core's read-only snapshot (``SchedulerCore.stats()``,
  ``core/view.py``) for gauges (queue sizes, live workers, policy versions, ...) and for the
  per-worker busy / idle / drafting seconds the core accumulates (closed segments plus the
  open one).
- ``GrpcMetricsInterceptor`` counts the final status of every gRPC call, and
  ``observe_weight_load`` takes the ``seconds`` that workers report in ``PolicyLoaded``.

Everything is emitted by one custom collector from plain numbers, so there are no ``_created``
series and one lock keeps a scrape consistent. Names are public API (STYLE habit 9): the
table ``SCHEDULER_METRICS`` lists them, ``tests/unit/test_metric_names.py`` checks them and
``docs/METRICS.md`` explains them.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from bubblespec.scheduler.core.types import Action, Assign, Deliver, PolicyLoadReported, RequestsMoved, StepFailed, StepFinished
from bubblespec.telemetry import Histogram, MetricSpec, family
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from bubblespec.common.types import Completion, StepSummary
    from bubblespec.scheduler.core.state import SchedulerCore
    from bubblespec.scheduler.core.view import StepView
    from bubblespec.scheduler.service import SchedulerService

__all__ = [
    "GrpcMetricsInterceptor",
    "Histogram",
    "MetricSpec",
    "SCHEDULER_METRICS",
    "SchedulerMetrics",
    "render",
]


SCHEDULER_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("bubblespec_requests_waiting", "gauge", "Requests queued and not yet running on a worker."),
    MetricSpec("bubblespec_requests_running", "gauge", "Requests running on workers."),
    MetricSpec("bubblespec_step_running", "gauge", "1 while a rollout step is in progress, else 0."),
    MetricSpec("bubblespec_last_progress_timestamp_seconds", "gauge",
               "Unix time of the last sign of progress: a step started, a token reported, a completion."),
    MetricSpec("bubblespec_workers_live", "gauge", "Workers connected to the scheduler."),
    MetricSpec("bubblespec_policy_version", "gauge", "Policy version loaded by each worker.", ("worker",)),
    MetricSpec("bubblespec_cluster_policy_version", "gauge", "Policy version the scheduler serves."),
    MetricSpec("bubblespec_worker_capacity", "gauge", "Requests a worker runs concurrently.", ("worker",)),
    MetricSpec("bubblespec_worker_busy_seconds_total", "counter",
               "Seconds a worker spent running requests or loading weights.", ("worker",)),
    MetricSpec("bubblespec_worker_idle_seconds_total", "counter",
               "Seconds a worker had nothing to run (bubbles).", ("worker",)),
    MetricSpec("bubblespec_worker_drafting_seconds_total", "counter",
               "Seconds a worker spent generating drafts for upcoming steps.", ("worker",)),
    MetricSpec("bubblespec_completions_total", "counter", "Completions delivered to trainers."),
    MetricSpec("bubblespec_generated_tokens_total", "counter", "Tokens in delivered completions."),
    MetricSpec("bubblespec_forward_passes_total", "counter",
               "Engine forward passes (decode steps) spent on delivered completions."),
    MetricSpec("bubblespec_spec_draft_tokens_total", "counter",
               "Draft tokens proposed to speculative decoding, by draft source.", ("source",)),
    MetricSpec("bubblespec_spec_accepted_tokens_total", "counter",
               "Draft tokens accepted by verification, by draft source.", ("source",)),
    MetricSpec("bubblespec_spec_acceptance_ratio", "gauge",
               "Accepted / proposed draft tokens of the latest step that proposed drafts (live while it runs)."),
    MetricSpec("bubblespec_step_makespan_seconds", "histogram",
               "Wall time from a step's submission to its last completion (cancelled steps excluded)."),
    MetricSpec("bubblespec_requests_moved_total", "counter",
               "Requests the straggler watch took from a slow worker or a stalled run and re-queued."),
    MetricSpec("bubblespec_requests_requeued_total", "counter",
               "Requests re-queued because their worker left, aborted them or produced the wrong version."),
    MetricSpec("bubblespec_requests_resumed_total", "counter",
               "Long running requests an idle worker took over, going on from what they generated (move_long_requests)."),
    MetricSpec("bubblespec_stragglers_detected_total", "counter",
               "Straggler interventions: times the straggler watch moved work of a step."),
    MetricSpec("bubblespec_steps_failed_total", "counter",
               "Steps ended in failure: one of their requests failed max_attempts times (poison requests)."),
    MetricSpec("bubblespec_draft_prompts_announced", "gauge", "Upcoming prompts the draft planner knows."),
    MetricSpec("bubblespec_draft_prompts_covered", "gauge", "Upcoming prompts with at least one draft made."),
    MetricSpec("bubblespec_weight_load_seconds", "histogram", "Seconds a worker took to load new policy weights."),
    MetricSpec("bubblespec_weight_load_failures_total", "counter", "Policy loads a worker reported as failed."),
    MetricSpec("bubblespec_worker_stream_messages_total", "counter",
               "Messages on the workers' streams, a batch counting once, by direction (received, sent).",
               ("direction",)),
    MetricSpec("bubblespec_scheduler_loop_stall_seconds_total", "counter",
               "Seconds the scheduler's event loop ran its periodic tick late, summed: time it read no worker stream."),
    MetricSpec("bubblespec_grpc_requests_total", "counter",
               "gRPC calls served, by full method name and final status code.", ("method", "code")),
    MetricSpec("bubblespec_draft_store_up", "gauge",
               "1 if the draft store answered its last operation, else 0 (only when the scheduler has a store)."),
    MetricSpec("bubblespec_draft_store_errors_total", "counter",
               "Draft store operations that failed (only when the scheduler has a store)."),
    MetricSpec("bubblespec_journal_rejected_total", "counter",
               "Step-journal records dropped instead of replayed: MAC mismatch, undecodable, or failing the "
               "checks a live completion passes (only when the scheduler keeps a journal)."),
)
_SPECS = {s.name: s for s in SCHEDULER_METRICS}

MAKESPAN_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)
WEIGHT_LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class _StepTally:
    drafted: int = 0
    accepted: int = 0


@dataclass
class _Tally:
    """Plain numbers the listener and the interceptor accumulate. Everything runs on the
    scheduler's event loop (the listener, the gRPC interceptor, ``/metrics``); ``lock`` keeps
    a scrape consistent should a collector ever run on another thread."""

    completions: int = 0
    tokens: int = 0
    forward_passes: int = 0
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    moved: int = 0
    resumed: int = 0
    requeued: int = 0
    stragglers: int = 0
    steps_failed: int = 0
    load_failures: int = 0
    last_completion: float = 0.0
    steps: dict[str, _StepTally] = field(default_factory=dict)
    grpc: dict[tuple[str, str], int] = field(default_factory=dict)
    makespan: Histogram = field(default_factory=lambda: Histogram(MAKESPAN_BUCKETS))
    weight_load: Histogram = field(default_factory=lambda: Histogram(WEIGHT_LOAD_BUCKETS))
    lock: threading.Lock = field(default_factory=threading.Lock)


class SchedulerMetrics(Collector):
    """The scheduler's exporter: listener, scrape-time collector and registry in one object.

    ``store`` may be set to a draft store (``.stats``, optionally ``.available``) that the
    scheduler process owns; without one the draft-store families are left out.
    """

    def __init__(self, service: SchedulerService, *, wall_clock: Callable[[], float] = time.time):
        self.core: SchedulerCore = service.core
        self.service = service
        self.wall_clock = wall_clock
        self.store = None
        self.started_wall = wall_clock()
        self.tally = _Tally()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        service.listeners.append(self.on_action)

    # ------------------------------------------------------------- events --

    def on_action(self, action: Action) -> None:
        """Listener on ``SchedulerService.listeners``: called with every core action."""
        if type(action) is Deliver:  # most actions are deliveries and assignments: no pattern matching for those
            self._on_deliver(action.step_id, action.completion)
            return
        if type(action) is Assign:
            return
        match action:
            case Deliver(step_id, completion):
                self._on_deliver(step_id, completion)
            case StepFinished(step_id, summary):
                self._on_step_finished(step_id, summary)
            case RequestsMoved(_, keys, requeued, resumed):
                self._on_moved(len(keys), requeued, resumed)
            case PolicyLoadReported(_, _, ok, _, seconds):
                self.observe_weight_load(ok, seconds)
            case StepFailed():
                with self.tally.lock:
                    self.tally.steps_failed += 1

    def _on_deliver(self, step_id: str, completion: Completion) -> None:
        prov = completion.provenance
        t = self.tally
        with t.lock:
            t.completions += 1
            t.tokens += len(completion.token_ids)
            t.forward_passes += prov.forward_passes
            t.last_completion = self.wall_clock()
            step = t.steps.setdefault(step_id, _StepTally())
            for s in prov.sources:
                t.drafted[s.source] = t.drafted.get(s.source, 0) + s.drafted_tokens
                t.accepted[s.source] = t.accepted.get(s.source, 0) + s.accepted_tokens
                step.drafted += s.drafted_tokens
                step.accepted += s.accepted_tokens

    def _on_step_finished(self, step_id: str, summary: StepSummary) -> None:
        view = self.core.step(step_id)
        t = self.tally
        with t.lock:
            if view is None or not view.cancelled:
                t.makespan.observe(summary.makespan_seconds)
            for old in [sid for sid in t.steps if not self.core.has_step(sid)]:
                del t.steps[old]  # the core trimmed it

    def _on_moved(self, count: int, requeued: bool, resumed: bool = False) -> None:
        """``RequestsMoved``: one straggler intervention moving ``count`` requests, ``count``
        requests re-queued (worker lost, aborted, paused off it), or long requests taken over by
        an idle worker (``resumed``)."""
        t = self.tally
        with t.lock:
            if resumed:
                t.resumed += count
            elif requeued:
                t.requeued += count
            else:
                t.stragglers += 1
                t.moved += count

    def observe_weight_load(self, ok: bool, seconds: float) -> None:
        """A worker answered the ``LoadPolicy`` it was asked (``PolicyLoadReported``)."""
        with self.tally.lock:
            if ok:
                self.tally.weight_load.observe(max(0.0, seconds))
            else:
                self.tally.load_failures += 1

    def count_rpc(self, method: str, code: grpc.StatusCode) -> None:
        with self.tally.lock:
            key = (method, code.name)
            self.tally.grpc[key] = self.tally.grpc.get(key, 0) + 1

    def grpc_interceptor(self) -> GrpcMetricsInterceptor:
        return GrpcMetricsInterceptor(self.count_rpc)

    # ------------------------------------------------------------- scrape --

    def collect(self) -> Iterator[Metric]:
        yield from self._collect_core()
        yield from self._collect_tally()
        yield from self._collect_store()
        counts = self.service.worker_messages
        yield family(_SPECS["bubblespec_worker_stream_messages_total"],
                     [(("received",), counts.received), (("sent",), counts.sent)])
        yield family(_SPECS["bubblespec_scheduler_loop_stall_seconds_total"], [((), self.service.loop_stalls.seconds)])
        journal = self.service.journal
        if journal is not None:
            yield family(_SPECS["bubblespec_journal_rejected_total"], [((), journal.rejected)])

    def _collect_core(self) -> Iterator[Metric]:
        stats = self.core.stats()
        workers, active = stats.workers, stats.active_steps
        yield from (
            family(_SPECS["bubblespec_requests_waiting"], [((), stats.requests_waiting)]),
            family(_SPECS["bubblespec_requests_running"], [((), stats.requests_running)]),
            family(_SPECS["bubblespec_step_running"], [((), 1 if active else 0)]),
            family(_SPECS["bubblespec_last_progress_timestamp_seconds"],
                   [((), self._last_progress(active, stats.now))]),
            family(_SPECS["bubblespec_workers_live"], [((), len(workers))]),
            family(_SPECS["bubblespec_policy_version"], [((w.worker_id,), w.policy_version) for w in workers]),
            family(_SPECS["bubblespec_cluster_policy_version"], [((), stats.policy_version)]),
            family(_SPECS["bubblespec_worker_capacity"], [((w.worker_id,), w.capacity) for w in workers]),
            family(_SPECS["bubblespec_draft_prompts_announced"], [((), stats.drafts_announced)]),
            family(_SPECS["bubblespec_draft_prompts_covered"], [((), stats.drafts_covered)]),
        )
        for state in ("busy", "idle", "drafting"):
            spec = _SPECS[f"bubblespec_worker_{state}_seconds_total"]
            yield family(spec, [((w.worker_id,), getattr(w, f"{state}_seconds")) for w in workers])
        yield family(_SPECS["bubblespec_spec_acceptance_ratio"], self._acceptance([s.step_id for s in stats.steps]))

    def _last_progress(self, active: tuple[StepView, ...], now: float) -> float:
        """Latest of: a step start, a token progress report, a completion (Unix seconds)."""
        offset = self.wall_clock() - now  # core clock (monotonic) -> Unix time
        latest = max([self.started_wall, self.tally.last_completion]
                     + [s.started_at + offset for s in active])
        for step in active:
            if step.last_progress_at > 0:
                latest = max(latest, step.last_progress_at + offset)
        return latest

    def _acceptance(self, step_ids: list[str]) -> list[tuple[tuple[()], float]]:
        with self.tally.lock:
            for sid in reversed(step_ids):
                step = self.tally.steps.get(sid)
                if step is not None and step.drafted > 0:
                    return [((), step.accepted / step.drafted)]
        return []  # no step proposed drafts yet: unknown, not zero

    def _collect_tally(self) -> list[Metric]:
        t = self.tally
        with t.lock:  # build under the lock, yield outside it
            return [
                family(_SPECS["bubblespec_completions_total"], [((), t.completions)]),
                family(_SPECS["bubblespec_generated_tokens_total"], [((), t.tokens)]),
                family(_SPECS["bubblespec_forward_passes_total"], [((), t.forward_passes)]),
                family(_SPECS["bubblespec_spec_draft_tokens_total"], [((k,), v) for k, v in sorted(t.drafted.items())]),
                family(_SPECS["bubblespec_spec_accepted_tokens_total"],
                       [((k,), v) for k, v in sorted(t.accepted.items())]),
                family(_SPECS["bubblespec_requests_moved_total"], [((), t.moved)]),
                family(_SPECS["bubblespec_requests_requeued_total"], [((), t.requeued)]),
                family(_SPECS["bubblespec_requests_resumed_total"], [((), t.resumed)]),
                family(_SPECS["bubblespec_stragglers_detected_total"], [((), t.stragglers)]),
                family(_SPECS["bubblespec_steps_failed_total"], [((), t.steps_failed)]),
                family(_SPECS["bubblespec_weight_load_failures_total"], [((), t.load_failures)]),
                family(_SPECS["bubblespec_grpc_requests_total"], sorted(t.grpc.items())),
                t.makespan.family(_SPECS["bubblespec_step_makespan_seconds"]),
                t.weight_load.family(_SPECS["bubblespec_weight_load_seconds"]),
            ]

    def _collect_store(self) -> Iterator[Metric]:
        store = self.store
        if store is None:
            return
        available = getattr(store, "available", None)
        if available is not None:
            yield family(_SPECS["bubblespec_draft_store_up"], [((), 1 if available else 0)])
        yield family(_SPECS["bubblespec_draft_store_errors_total"], [((), store.stats.errors)])

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# ----------------------------------------------------------------- gRPC --


class GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts the final status code of every call to a registered method.

    Put it first in the server's interceptor list so that calls other interceptors refuse
    (authentication) are counted too. Unknown methods (no handler) are not counted: their
    names are unbounded.
    """

    def __init__(self, count: Callable[[str, grpc.StatusCode], None]):
        self.count = count

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.lstrip("/")
        kind = ("stream_stream" if handler.request_streaming and handler.response_streaming
                else "unary_stream" if handler.response_streaming
                else "stream_unary" if handler.request_streaming else "unary_unary")
        behavior = getattr(handler, kind)
        if behavior is None:
            return handler
        wrap = _wrap_generator if inspect.isasyncgenfunction(behavior) else _wrap_coroutine
        return handler._replace(**{kind: wrap(behavior, method, self.count)})


def _final_code(context: Any, exc: BaseException | None) -> grpc.StatusCode:
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        return (grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0
                else grpc.StatusCode.CANCELLED)
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):  # some grpc versions hand back the raw integer
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    return grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN


def _wrap_coroutine(behavior: Any, method: str, count: Callable[[str, grpc.StatusCode], None]) -> Any:
    async def wrapper(request: Any, context: Any) -> Any:
        exc: BaseException | None = None
        try:
            return await behavior(request, context)
        except BaseException as e:
            exc = e
            raise
        finally:
            count(method, _final_code(context, exc))

    return wrapper


def _wrap_generator(behavior: Any, method: str, count: Callable[[str, grpc.StatusCode], None]) -> Any:
    async def wrapper(request: Any, context: Any) -> AsyncIterator[Any]:
        exc: BaseException | None = None
        try:
            async for item in behavior(request, context):
                yield item
        except BaseException as e:
            exc = e
            raise
        finally:
            count(method, _final_code(context, exc))

    return wrapper


# ------------------------------------------------------------------ entry --


def render(scheduler: Any) -> tuple[bytes, str]:
    """The body and content type of ``GET /metrics`` for ``scheduler`` (a ``Scheduler``: its
    ``service`` and, once made, its ``metrics``)."""
    metrics = getattr(scheduler, "metrics", None)
    if metrics is None:  # a Scheduler built without the hook: counts start now
        metrics = scheduler.metrics = SchedulerMetrics(scheduler.service)
    return metrics.render()

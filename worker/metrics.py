"""Prometheus exporter of a worker: what the agent and its draft store know, read at scrape time.

The scheduler's /metrics already covers the cluster (per-worker time, tokens, acceptance);
a worker's /metrics adds what only the worker sees: its tasks right now, its draft-job time,
the policy version it has actually loaded, and its draft store (Redis) health.

One ``WorkerMetrics`` (and registry) per agent, created on first scrape; never the global
registry. The store's ``StoreStats`` carry an operation count and a summed duration, not
per-operation durations, so ``bubblespec_draft_store_op_seconds`` buckets each scrape
interval's operations at that interval's mean duration: ``_count`` and ``_sum`` are exact,
quantiles are the spread of interval means (docs/METRICS.md).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from bubblespec.telemetry import Histogram, MetricSpec, family
from bubblespec.worker.agent import WorkerAgent
from bubblespec.worker.runner import DRAFT_PREFIX, TOKENS_WINDOW_SECONDS

__all__ = ["DRAFT_STORE_OP_BUCKETS", "WORKER_METRICS", "MetricSpec", "WorkerMetrics", "render"]


WORKER_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("bubblespec_worker_info", "gauge", "Always 1; names the worker this endpoint belongs to.", ("worker",)),
    MetricSpec("bubblespec_worker_connected", "gauge", "1 while the worker's stream to the scheduler is up."),
    MetricSpec("bubblespec_worker_requests_running", "gauge", "Assigned requests running on this worker's engine."),
    MetricSpec("bubblespec_worker_draft_jobs_running", "gauge", "Draft jobs running on this worker's engine."),
    MetricSpec("bubblespec_worker_draft_job_seconds_total", "counter",
               "Seconds spent in draft jobs, summed over jobs (concurrent jobs add up)."),
    MetricSpec("bubblespec_worker_policy_version", "gauge", "Policy version whose weights this worker has loaded."),
    MetricSpec("bubblespec_worker_tokens_per_second", "gauge",
               "Tokens generated per second over the last 5 s window (as sent in heartbeats)."),
    MetricSpec("bubblespec_worker_draft_token_seconds", "gauge",
               "Seconds one draft token adds to this worker's engine pass, as its draft-length rule takes it (set by "
               "--draft-token-seconds, or measured by the engine as it runs); 0 while unknown (drafts by acceptance)."),
    MetricSpec("bubblespec_worker_drafted_request_seconds", "gauge",
               "Seconds each request with a draft adds to this worker's engine pass beyond its draft tokens, as the "
               "engine measured it; 0 where its passes cannot tell that apart from the tokens' cost."),
    MetricSpec("bubblespec_worker_spec_drafted_tokens_total", "counter",
               "Draft tokens proposed for this worker's completed requests, by draft source "
               "(future, history, sibling, suffix).", ("source",)),
    MetricSpec("bubblespec_worker_spec_accepted_tokens_total", "counter",
               "Draft tokens the target model accepted in this worker's completed requests, by draft source.",
               ("source",)),
    MetricSpec("bubblespec_draft_store_up", "gauge",
               "1 if the draft store answered its last operation, 0 while it is failing."),
    MetricSpec("bubblespec_draft_store_ops_total", "counter", "Draft store operations attempted against the backend."),
    MetricSpec("bubblespec_draft_store_errors_total", "counter",
               "Draft store operations that failed (unreachable, refused, timed out)."),
    MetricSpec("bubblespec_draft_store_corrupt_entries_total", "counter",
               "Stored drafts or lengths that could not be decoded and were skipped."),
    MetricSpec("bubblespec_draft_store_oversized_entries_total", "counter",
               "Draft entries over the store's max_entry_bytes: not written, or skipped unread."),
    MetricSpec("bubblespec_draft_store_op_seconds", "histogram",
               "Duration of draft store operations (bucketed at each scrape interval's mean)."),
)
_SPECS = {s.name: s for s in WORKER_METRICS}

DRAFT_STORE_OP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class WorkerMetrics(Collector):
    """Reads ``agent`` (a ``WorkerAgent``) at scrape time."""

    def __init__(self, agent: WorkerAgent):
        self._agent = weakref.ref(agent)  # the module's registry of exporters must not keep agents alive
        self.op_seconds = Histogram(DRAFT_STORE_OP_BUCKETS)
        self._seen_ops = 0
        self._seen_seconds = 0.0
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        a = self._agent()
        if a is None:
            return
        r = a.runner
        tasks = list(r.tasks)  # one C-level copy: scrapes run on a thread, the loop mutates
        drafts = sum(1 for key in tasks if key.startswith(DRAFT_PREFIX))
        yield from (
            family(_SPECS["bubblespec_worker_info"], [((a.worker_id,), 1)]),
            family(_SPECS["bubblespec_worker_connected"], [((), 1 if a.link.connected.is_set() else 0)]),
            family(_SPECS["bubblespec_worker_requests_running"], [((), len(tasks) - drafts)]),
            family(_SPECS["bubblespec_worker_draft_jobs_running"], [((), drafts)]),
            family(_SPECS["bubblespec_worker_draft_job_seconds_total"], [((), r.draft_seconds)]),
            family(_SPECS["bubblespec_worker_policy_version"], [((), a.weights.version)]),
            family(_SPECS["bubblespec_worker_tokens_per_second"], [((), _tokens_per_second(r.tokens_window))]),
        )
        if r.draft_token_seconds is not None:
            yield family(_SPECS["bubblespec_worker_draft_token_seconds"], [((), r.draft_token_seconds)])
            yield family(_SPECS["bubblespec_worker_drafted_request_seconds"], [((), r.drafted_request_seconds)])
        spec = sorted(r.spec_tokens.items())
        yield family(_SPECS["bubblespec_worker_spec_drafted_tokens_total"], [((src,), v[0]) for src, v in spec])
        yield family(_SPECS["bubblespec_worker_spec_accepted_tokens_total"], [((src,), v[1]) for src, v in spec])
        yield from self._collect_store(r.store)

    def _collect_store(self, store: Any) -> Iterator[Metric]:
        if store is None:
            return
        stats = store.stats
        available = getattr(store, "available", None)
        if available is not None:
            yield family(_SPECS["bubblespec_draft_store_up"], [((), 1 if available else 0)])
        yield family(_SPECS["bubblespec_draft_store_ops_total"], [((), stats.ops)])
        yield family(_SPECS["bubblespec_draft_store_errors_total"], [((), stats.errors)])
        yield family(_SPECS["bubblespec_draft_store_corrupt_entries_total"], [((), stats.corrupt_entries)])
        yield family(_SPECS["bubblespec_draft_store_oversized_entries_total"], [((), stats.oversized_entries)])
        with self._lock:  # concurrent scrapes must not count one interval twice
            ops, seconds = stats.ops - self._seen_ops, stats.op_seconds_sum - self._seen_seconds
            if ops > 0:
                self.op_seconds.observe(max(0.0, seconds) / ops, count=ops, total=max(0.0, seconds))
            self._seen_ops, self._seen_seconds = stats.ops, stats.op_seconds_sum
            histogram = self.op_seconds.family(_SPECS["bubblespec_draft_store_op_seconds"])
        yield histogram

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _tokens_per_second(tokens_window: list[tuple[float, int]]) -> float:
    now = time.monotonic()
    window = list(tokens_window)
    return sum(n for t, n in window if now - t < TOKENS_WINDOW_SECONDS) / TOKENS_WINDOW_SECONDS


_EXPORTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_EXPORTERS_LOCK = threading.Lock()


def render(agent: WorkerAgent) -> tuple[bytes, str]:
    """The body and content type of the worker's ``GET /metrics``."""
    with _EXPORTERS_LOCK:
        exporter = _EXPORTERS.get(agent)
        if exporter is None:
            exporter = _EXPORTERS[agent] = WorkerMetrics(agent)
    return exporter.render()

"""Metric names are public API (STYLE habit 9): check every family both exporters expose.

Rules: prefix ``bubblespec_``, snake_case, base units only, ``_total`` on counters and only on
counters, labels from a small bounded set (never an id of a request, prompt or step). Also:
the spec tables match what is exposed, docs/METRICS.md documents every name, and every name
the Grafana dashboard and the alert rules query is exported.

The second half drives the scheduler exporter with the pure core and a fake clock (no I/O)
to check what the numbers mean: worker time, draft acceptance, straggler interventions.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common.types import Completion, FinishReason, Provenance, SamplingParams, SchedulingPolicy, SourceStats
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.state import SchedulerCore
from bubblespec.scheduler.core.types import Assign, ModelLimits, PromptSpec, StepSpec, WorkerHello
from bubblespec.scheduler.metrics import SCHEDULER_METRICS, SchedulerMetrics
from bubblespec.scheduler.service import SchedulerService
from bubblespec.scheduler.wire import feed
from bubblespec.store import DraftEntry, DraftSource, MemoryStore, ResilientStore, prompt_key
from bubblespec.worker.metrics import WORKER_METRICS, WorkerMetrics
from prometheus_client.parser import text_string_to_metric_families

from tests.support.clock import FakeClock

ROOT = Path(__file__).resolve().parents[2]
WALL = 1_700_000_000.0
ALLOWED_LABELS = {"worker", "source", "method", "code", "direction"}
BASE_UNITS = ("seconds", "bytes", "ratio")
FOREIGN_UNITS = {"ms", "millis", "milliseconds", "us", "microseconds", "ns", "nanoseconds", "minutes", "hours",
                 "days", "kb", "mb", "gb", "kib", "mib", "gib", "kilobytes", "megabytes", "percent", "pct"}
ID_LIKE = re.compile(r"(^|_)(id|ids|key|uuid|request|prompt|step)$")


# ------------------------------------------------------------- fixtures --


def _hello(worker_id: str, capacity: int = 4) -> WorkerHello:
    return WorkerHello(worker_id, capacity, 0, ModelLimits(512, 128), speculation=True)


def _step(step_id: str, prompts: int, policy: SchedulingPolicy = SchedulingPolicy.QUEUE) -> StepSpec:
    return StepSpec(step_id, 0, tuple(PromptSpec(f"p{i}", (5, 6, i), 16) for i in range(prompts)),
                    SamplingParams(temperature=0.0), policy=policy)


def _completion(a: Assign, tokens: int = 10, passes: int = 6,
                sources=(("history", 8, 6), ("future", 4, 1))) -> Completion:
    r = a.request
    return Completion(r.step_id, r.prompt_id, r.sample_index, (7,) * tokens, (0.0,) * tokens, "",
                      FinishReason.STOP, r.policy_version, a.worker_id, 3,
                      Provenance(passes, tuple(SourceStats(*s) for s in sources)))


class Harness:
    """The pure core behind a service (no links, no loop needed) with the exporter listening."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.core = SchedulerCore(CoreSettings(), clock=self.clock)
        self.service = SchedulerService(self.core)
        self.metrics = SchedulerMetrics(self.service, wall_clock=lambda: WALL + self.clock())
        self.assigned: list[Assign] = []

    def run(self, actions) -> None:
        self.assigned += [a for a in actions if isinstance(a, Assign)]
        self.service.execute(actions)

    def complete(self, a: Assign, **kw) -> None:
        self.assigned.remove(a)
        self.run(self.core.on_completion(a.worker_id, a.request.key, _completion(a, **kw)))

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        body, _ = self.metrics.render()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}

    def value(self, name: str, **labels) -> float:
        return self.samples()[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def fed() -> Harness:
    """A scheduler exporter that has seen one finished step, a weight load, RPCs and a store."""
    h = Harness()
    for w in ("w0", "w1"):
        h.run(h.core.add_worker(_hello(w)))
    h.run(h.core.submit_step(_step("s1", 4)))
    for a in list(h.assigned):
        h.clock.advance(1.0)
        h.complete(a)
    h.run(h.core.update_policy(1, "/weights/v1"))
    feed(h.service, "w0", pb.WorkerMessage(policy_loaded=pb.PolicyLoaded(version=1, ok=True, seconds=2.0)))
    h.metrics.count_rpc("bubblespec.v1.Rollout/Status", grpc.StatusCode.OK)
    h.metrics.store = ResilientStore(MemoryStore())
    h.service.journal = _Journal()  # read at scrape time only
    return h


class _Journal:
    rejected = 2


class FakeAgent:
    """What the worker's exporter reads of a ``WorkerAgent``: its link, runner and weights."""

    def __init__(self, store) -> None:
        self.worker_id = "w0"
        self.runner = SimpleNamespace(tasks={"s/p/0": None, "draft:d1": None}, draft_seconds=1.5,
                                      spec_tokens={"future": [10, 7], "suffix": [4, 3]}, draft_token_seconds=3.0e-5,
                                      drafted_request_seconds=2.8e-5, tokens_window=[], store=store)
        self.weights = SimpleNamespace(version=2)
        self.link = SimpleNamespace(connected=asyncio.Event())


def _families(collector) -> list:
    return list(collector.collect())


def _exposed(fam) -> str:
    return fam.name + "_total" if fam.type == "counter" else fam.name


# ---------------------------------------------------------------- names --


def _all_families(fed: Harness) -> list:
    agent = FakeAgent(ResilientStore(MemoryStore()))  # the exporter holds its agent weakly
    return _families(fed.metrics) + _families(WorkerMetrics(agent))


def test_names_prefix_snake_case_and_units(fed):
    for fam in _all_families(fed):
        name = _exposed(fam)
        assert name.startswith("bubblespec_"), name
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", name), f"{name}: not snake_case"
        words = set(name.split("_"))
        assert not words & FOREIGN_UNITS, f"{name}: use base units ({', '.join(BASE_UNITS)})"
        stem = name.removesuffix("_total")
        for unit in BASE_UNITS:
            if unit in stem.split("_")[1:]:
                assert stem.endswith("_" + unit), f"{name}: the unit goes last"
        if fam.type == "histogram":
            assert stem.endswith(tuple("_" + u for u in BASE_UNITS)), f"{name}: a histogram needs a base unit"


def test_total_only_on_counters_and_every_counter_has_it(fed):
    specs = {s.name: s for s in (*SCHEDULER_METRICS, *WORKER_METRICS)}
    for spec in specs.values():
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
    for fam in _all_families(fed):
        for sample in fam.samples:
            if fam.type == "counter":
                assert sample.name.endswith("_total"), f"{sample.name}: counter sample without _total"
            else:
                assert not sample.name.endswith("_total"), f"{sample.name}: _total on a {fam.type}"
            assert not sample.name.endswith("_created"), f"{sample.name}: no _created series"


def test_labels_are_bounded(fed):
    for fam in _all_families(fed):
        for sample in fam.samples:
            labels = set(sample.labels) - ({"le"} if fam.type == "histogram" else set())
            assert labels <= ALLOWED_LABELS, f"{sample.name}: unexpected labels {labels - ALLOWED_LABELS}"
            for label in labels:
                assert label in ALLOWED_LABELS or not ID_LIKE.search(label), f"{sample.name}: id-like label {label}"
    for spec in (*SCHEDULER_METRICS, *WORKER_METRICS):
        assert set(spec.labels) <= ALLOWED_LABELS, spec.name


def test_spec_tables_match_what_is_exposed(fed):
    exposed = {(_exposed(f), f.type) for f in _families(fed.metrics)}
    assert exposed == {(s.name, s.kind) for s in SCHEDULER_METRICS}
    agent = FakeAgent(ResilientStore(MemoryStore()))
    exposed = {(_exposed(f), f.type) for f in _families(WorkerMetrics(agent))}
    assert exposed == {(s.name, s.kind) for s in WORKER_METRICS}
    for spec in (*SCHEDULER_METRICS, *WORKER_METRICS):
        assert spec.help.endswith("."), f"{spec.name}: help should be a sentence"


def test_shared_names_mean_the_same_on_both_sides():
    scheduler = {s.name: s for s in SCHEDULER_METRICS}
    for spec in WORKER_METRICS:
        if spec.name in scheduler:
            assert (spec.kind, spec.labels) == (scheduler[spec.name].kind, scheduler[spec.name].labels), spec.name


def test_docs_list_every_metric():
    doc = (ROOT / "docs" / "METRICS.md").read_text()
    missing = [s.name for s in (*SCHEDULER_METRICS, *WORKER_METRICS) if f"`{s.name}`" not in doc]
    assert not missing, f"docs/METRICS.md does not document {missing}"


def test_dashboard_and_alerts_only_query_exported_names():
    exported = {s.name for s in (*SCHEDULER_METRICS, *WORKER_METRICS)}
    text = ((ROOT / "deploy" / "grafana" / "bubblespec-dashboard.json").read_text()
            + (ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    queried = {re.sub(r"_(bucket|count|sum)$", "", n) for n in re.findall(r"bubblespec_[a-z0-9_]+", text)}
    queried = {n for n in queried if not n.startswith("bubblespec_dashboard")}
    assert queried, "no metric found in the deploy assets"
    assert queried <= exported, f"queried but not exported: {sorted(queried - exported)}"


# ------------------------------------------------------------ behaviour --


def test_completions_tokens_and_acceptance_by_source(fed):
    assert fed.value("bubblespec_completions_total") == 4
    assert fed.value("bubblespec_generated_tokens_total") == 40
    assert fed.value("bubblespec_forward_passes_total") == 24
    assert fed.value("bubblespec_spec_draft_tokens_total", source="history") == 32
    assert fed.value("bubblespec_spec_accepted_tokens_total", source="future") == 4
    assert fed.value("bubblespec_spec_acceptance_ratio") == pytest.approx(28 / 48)
    assert fed.value("bubblespec_step_makespan_seconds_count") == 1
    assert fed.value("bubblespec_step_makespan_seconds_sum") == pytest.approx(4.0)
    assert fed.value("bubblespec_weight_load_seconds_count") == 1
    assert fed.value("bubblespec_weight_load_seconds_bucket", le="2.5") == 1
    assert fed.value("bubblespec_grpc_requests_total", method="bubblespec.v1.Rollout/Status", code="OK") == 1
    assert fed.value("bubblespec_draft_store_up") == 1


def test_acceptance_ratio_is_absent_until_drafts_were_proposed():
    h = Harness()
    h.run(h.core.add_worker(_hello("w0")))
    h.run(h.core.submit_step(_step("s1", 1)))
    h.complete(h.assigned[0], sources=())
    assert not any(name == "bubblespec_spec_acceptance_ratio" for name, _ in h.samples())


def test_worker_seconds_include_the_open_segment_and_never_go_back():
    h = Harness()
    h.run(h.core.add_worker(_hello("w0")))
    h.clock.advance(3.0)  # idle, open segment
    assert h.value("bubblespec_worker_idle_seconds_total", worker="w0") == pytest.approx(3.0)
    h.run(h.core.submit_step(_step("s1", 1)))
    h.clock.advance(2.0)  # busy, open segment
    before = h.samples()
    h.complete(h.assigned[0])  # closes the busy segment
    h.clock.advance(1.0)
    after = h.samples()
    for key, value in before.items():
        if key[0].startswith("bubblespec_worker_") and key[0].endswith("_seconds_total"):
            assert after[key] >= value, key
    assert h.value("bubblespec_worker_busy_seconds_total", worker="w0") == pytest.approx(2.0)
    assert h.value("bubblespec_worker_idle_seconds_total", worker="w0") == pytest.approx(4.0)
    assert h.value("bubblespec_step_running") == 0


def test_step_running_queue_gauges_and_last_progress():
    h = Harness()
    h.run(h.core.add_worker(_hello("w0", capacity=2)))
    h.clock.advance(5.0)
    h.run(h.core.submit_step(_step("s1", 5)))
    assert h.value("bubblespec_step_running") == 1
    assert h.value("bubblespec_requests_running") == 2
    assert h.value("bubblespec_requests_waiting") == 3
    assert h.value("bubblespec_last_progress_timestamp_seconds") == pytest.approx(WALL + 1005.0)
    h.clock.advance(4.0)
    h.core.on_progress("w0", h.assigned[0].request.key, 3)
    h.clock.advance(4.0)
    assert h.value("bubblespec_last_progress_timestamp_seconds") == pytest.approx(WALL + 1009.0)
    assert h.value("bubblespec_policy_version", worker="w0") == 0
    assert h.value("bubblespec_workers_live") == 1


def test_slow_worker_and_stalled_request_count_as_straggler_interventions():
    h = Harness()
    for w in ("fast", "slow"):
        h.run(h.core.add_worker(_hello(w, capacity=1)))
    h.run(h.core.submit_step(_step("s1", 6, SchedulingPolicy.STATIC)))
    h.clock.advance(3.0)
    h.core.heartbeat("fast", 100.0)
    h.core.heartbeat("slow", 10.0)
    h.run(h.core.tick())  # the slow worker's queued work goes to the shared queue; nobody is free yet
    fast = next(a for a in h.assigned if a.worker_id == "fast")
    h.complete(fast)  # the next action of the step reveals the move
    assert h.value("bubblespec_stragglers_detected_total") == 1
    assert h.value("bubblespec_requests_moved_total") == 2
    h.clock.advance(CoreSettings().stall_seconds + 1)
    h.core.heartbeat("fast", 100.0)
    h.core.heartbeat("slow", 10.0)
    h.run(h.core.tick())  # both running requests stalled: aborted and moved
    assert h.value("bubblespec_stragglers_detected_total") == 2
    assert h.value("bubblespec_requests_moved_total") == 4


def test_cancelled_steps_stay_out_of_the_makespan_histogram():
    h = Harness()
    h.run(h.core.add_worker(_hello("w0")))
    h.run(h.core.submit_step(_step("s1", 2)))
    h.service.execute(h.core.cancel_step("s1"))
    assert h.value("bubblespec_step_makespan_seconds_count") == 0
    assert h.value("bubblespec_step_running") == 0


def test_worker_exporter_reads_agent_and_store():
    store = ResilientStore(MemoryStore())
    agent = FakeAgent(store)
    exporter = WorkerMetrics(agent)
    entry = DraftEntry((1, 2, 3), 0, "s1", DraftSource.HISTORY, 0.0)

    async def ops() -> None:
        for _ in range(3):
            await store.put_draft(prompt_key((1, 2)), entry)

    asyncio.run(ops())
    samples = {s.name: s.value for f in _families(exporter) for s in f.samples if not s.labels or "worker" in s.labels}
    assert samples["bubblespec_worker_requests_running"] == 1
    assert samples["bubblespec_worker_draft_jobs_running"] == 1
    assert samples["bubblespec_worker_policy_version"] == 2
    assert samples["bubblespec_draft_store_ops_total"] == 3
    assert samples["bubblespec_draft_store_op_seconds_count"] == 3
    assert samples["bubblespec_draft_store_op_seconds_sum"] == pytest.approx(store.stats.op_seconds_sum)
    assert samples["bubblespec_draft_store_up"] == 1
    by_source = {(s.name, s.labels.get("source")): s.value for f in _families(exporter) for s in f.samples}
    assert by_source[("bubblespec_worker_spec_drafted_tokens_total", "suffix")] == 4
    assert by_source[("bubblespec_worker_spec_accepted_tokens_total", "suffix")] == 3
    assert by_source[("bubblespec_worker_spec_accepted_tokens_total", "future")] == 7
    assert samples["bubblespec_worker_draft_token_seconds"] == 3.0e-5
    assert samples["bubblespec_worker_drafted_request_seconds"] == 2.8e-5
    agent.runner.draft_token_seconds = None  # an engine without speculation, or not read yet: no gauge
    names = {f.name for f in _families(exporter)}
    assert "bubblespec_worker_draft_token_seconds" not in names and "bubblespec_worker_drafted_request_seconds" not in names


def test_requests_of_a_lost_worker_count_as_requeued_not_moved():
    h = Harness()
    for w in ("w0", "w1"):
        h.run(h.core.add_worker(_hello(w, capacity=1)))
    h.run(h.core.submit_step(_step("s1", 2)))
    h.run(h.core.remove_worker("w1"))  # its request goes back to the queue; w0 is full
    h.assigned = [a for a in h.assigned if a.worker_id == "w0"]
    h.complete(h.assigned[0])  # w0 takes the re-queued request: revealed
    assert h.value("bubblespec_requests_requeued_total") == 1
    assert h.value("bubblespec_requests_moved_total") == 0
    assert h.value("bubblespec_stragglers_detected_total") == 0
    h.complete(h.assigned[0])
    assert h.value("bubblespec_requests_requeued_total") == 1  # the summary adds nothing twice
    assert h.value("bubblespec_workers_live") == 1


def test_a_long_request_taken_over_by_an_idle_worker_counts_as_resumed_not_as_a_straggler():
    from dataclasses import replace as _replace

    h = Harness()
    h.core.settings = _replace(h.core.settings, min_tokens_to_move=4)
    h.run(h.core.add_worker(_replace(_hello("w0", capacity=2), accepts_resume=True)))
    h.run(h.core.add_worker(_replace(_hello("w1", capacity=1), accepts_resume=True)))
    h.run(h.core.submit_step(_step("s1", 3)))
    for a in [a for a in h.assigned if a.worker_id == "w0"]:
        h.run(h.core.on_progress("w0", a.request.key, 8))
    short = next(a for a in h.assigned if a.worker_id == "w1")
    h.assigned.remove(short)
    actions = h.core.on_completion("w1", short.request.key, _completion(short))  # w1 runs out of work
    actions += h.core.tick()  # the tick pairs it with the long requests on w0
    h.service.execute(actions)
    (stop,) = [x for x in actions if type(x).__name__ == "Abort"]
    moving = next(a for a in h.assigned if a.request.key == stop.key)
    partial = Completion("s1", moving.request.prompt_id, 0, (1, 2, 3, 4, 5), (), "", FinishReason.STOP, 0, "w0")
    h.run(h.core.on_aborted("w0", stop.key, "moved", partial))
    assert h.value("bubblespec_requests_resumed_total") == 1
    assert h.value("bubblespec_requests_moved_total") == 0
    assert h.value("bubblespec_stragglers_detected_total") == 0

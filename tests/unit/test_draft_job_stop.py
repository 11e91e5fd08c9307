"""A stopped draft job (``Runner.stop_draft``, ``_run_draft``): the stop does not hold
the messages behind it, and the job's partial draft is stored, then reported, after its abort.

A worker stops up to its whole width of jobs at a step's start. Each abort waits for the
engine (the job's proposer stats come with it), a few milliseconds each: awaited one by one
in the stream's message loop, they kept the step's assignments queued behind them for tens of
milliseconds. A failed store is reported as no tokens: no prompt counts as drafted without a
draft."""

from __future__ import annotations

import asyncio

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common.types import FinishReason, Provenance
from bubblespec.store import ResilientStore, StoreSettings, prompt_key
from bubblespec.store.memory import MemoryStore
from bubblespec.store.types import StoreUnavailable
from bubblespec.worker.agent import WorkerAgent
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.engine import EngineInfo, EngineOutput, EngineRequest
from tests.unit.test_worker_policy_load import sent

PROMPT = (5, 6, 7)


class SlowAbortEngine:
    """Generates ``tokens`` then waits for ever; ``abort`` waits until ``release`` is set."""

    def __init__(self, tokens: tuple[int, ...] = (11, 12, 13)) -> None:
        self.info = EngineInfo("m", 64, 32, True, "raw_logprobs")
        self.tokens = tokens
        self.generating = asyncio.Event()
        self.release = asyncio.Event()
        self.events: list[str] = []

    async def generate(self, request: EngineRequest):
        out: list[int] = []
        for t in self.tokens:
            out.append(t)
            yield EngineOutput(request.key, out, (), "", None, Provenance())
        self.generating.set()
        await asyncio.Event().wait()
        yield EngineOutput(request.key, tuple(out), (), "", FinishReason.LENGTH, Provenance())  # never reached

    async def abort(self, key: str) -> None:
        self.events.append(f"abort {key} begins")
        await self.release.wait()
        self.events.append(f"abort {key} ends")


class FailingStore(MemoryStore):
    async def put_draft(self, prompt_key, entry):
        raise ConnectionError("store down")


class UnreachableStore(MemoryStore):
    """A backend whose writes fail as Redis's do when it cannot be reached."""

    async def put_draft(self, prompt_key, entry):
        raise StoreUnavailable("connection refused")


def _job(job_id: str) -> pb.SchedulerMessage:
    return pb.SchedulerMessage(draft_job=pb.DraftJob(job_id=job_id, prompt_token_ids=list(PROMPT), policy_version=3,
                                                     sampling=pb.SamplingParams(max_tokens=64)))


def _results(agent: WorkerAgent) -> list[pb.DraftResult]:
    out = []
    while not agent.link.outbox.empty():
        msg = agent.link.outbox.get_nowait()
        if msg.WhichOneof("kind") == "draft_result":
            out.append(msg.draft_result)
    return out


async def _stop_when_generating(agent: WorkerAgent, engine: SlowAbortEngine, job_id: str) -> None:
    await agent.handle(_job(job_id))
    await asyncio.wait_for(engine.generating.wait(), 5)
    await agent.handle(pb.SchedulerMessage(stop_draft=pb.StopDraft(job_id=job_id)))


async def test_a_stopped_job_aborts_then_stores_and_reports_its_partial_draft() -> None:
    engine, store = SlowAbortEngine(), MemoryStore()
    agent = WorkerAgent(WorkerSettings(worker_id="w"), engine, store)  # type: ignore[arg-type]
    await asyncio.wait_for(_stop_when_generating(agent, engine, "d1"), 5)  # returns while the abort still waits
    for _ in range(100):
        if engine.events:
            break
        await asyncio.sleep(0.01)
    assert engine.events == ["abort draft:d1 begins"] and _results(agent) == []
    assert "draft:d1" not in agent.runner.tasks
    engine.release.set()
    await asyncio.wait_for(agent.runner.drop_all(), 5)  # waits for the stopped job's cleanup
    assert engine.events == ["abort draft:d1 begins", "abort draft:d1 ends"]
    [result] = _results(agent)
    assert (result.job_id, result.tokens, result.finished) == ("d1", 3, False)
    [entry] = (await store.get_drafts([prompt_key(PROMPT)]))[prompt_key(PROMPT)]
    assert entry.tokens == (11, 12, 13) and entry.policy_version == 3
    assert agent.runner.draft_tokens == {}


async def test_stops_do_not_wait_for_each_others_aborts() -> None:
    engine = SlowAbortEngine()
    agent = WorkerAgent(WorkerSettings(worker_id="w"), engine, MemoryStore())  # type: ignore[arg-type]
    for job in ("d1", "d2", "d3"):
        engine.generating.clear()
        await asyncio.wait_for(_stop_when_generating(agent, engine, job), 5)  # none blocks on the abort before it
    await asyncio.sleep(0.05)
    assert sorted(e for e in engine.events) == [f"abort draft:{j} begins" for j in ("d1", "d2", "d3")]
    engine.release.set()
    await asyncio.wait_for(agent.runner.drop_all(), 5)
    assert sum(e.endswith("ends") for e in engine.events) == 3
    assert sorted((r.job_id, r.tokens) for r in _results(agent)) == [("d1", 3), ("d2", 3), ("d3", 3)]


async def test_a_draft_the_store_refused_is_reported_as_no_tokens() -> None:
    engine = SlowAbortEngine()
    engine.release.set()
    agent = WorkerAgent(WorkerSettings(worker_id="w"), engine, FailingStore())  # type: ignore[arg-type]
    await asyncio.wait_for(_stop_when_generating(agent, engine, "d1"), 5)
    await asyncio.wait_for(agent.runner.drop_all(), 5)
    [result] = _results(agent)
    assert (result.tokens, result.finished) == (0, False)  # not counted as a draft the store does not hold
    assert engine.events == ["abort draft:d1 begins", "abort draft:d1 ends"]


async def _report_of_one_stopped_job(store) -> pb.DraftResult:
    engine = SlowAbortEngine(tokens=tuple(range(11, 311)))  # 300 tokens: 1,242 bytes encoded
    engine.release.set()
    agent = WorkerAgent(WorkerSettings(worker_id="w"), engine, store)  # type: ignore[arg-type]
    await asyncio.wait_for(_stop_when_generating(agent, engine, "d1"), 5)
    await asyncio.wait_for(agent.runner.drop_all(), 5)
    [result] = _results(agent)
    return result


async def test_a_draft_the_resilient_store_dropped_is_reported_as_no_tokens() -> None:
    """Workers reach Redis through ``ResilientStore``, which never raises: a write it dropped
    (backend down, then the breaker open) must still not be reported as a stored draft."""
    store = ResilientStore(UnreachableStore(), StoreSettings(retry_after_seconds=60.0))
    first = await _report_of_one_stopped_job(store)
    assert (first.tokens, first.finished) == (0, False) and not store.available
    second = await _report_of_one_stopped_job(store)  # breaker open: dropped without a call
    assert (second.tokens, second.finished) == (0, False)
    assert store.skipped_ops == 2  # the job's draft lookup and its write


async def test_an_oversized_draft_is_reported_as_no_tokens() -> None:
    store = MemoryStore(StoreSettings(max_entry_bytes=1024))
    result = await _report_of_one_stopped_job(store)
    assert (result.tokens, result.finished) == (0, False)
    assert store.stats.oversized_entries == 1
    assert (await store.get_drafts([prompt_key(PROMPT)]))[prompt_key(PROMPT)] == []


async def test_a_stored_draft_is_reported_with_its_tokens_through_the_resilient_store() -> None:
    store = ResilientStore(MemoryStore(), StoreSettings())
    result = await _report_of_one_stopped_job(store)
    assert result.tokens == 300
    [entry] = (await store.get_drafts([prompt_key(PROMPT)]))[prompt_key(PROMPT)]
    assert len(entry.tokens) == 300


class LoadingEngine(SlowAbortEngine):
    """``load_weights`` fails, as vLLM's prefix-cache reset does, while a request is still in
    the engine (begun and not aborted)."""

    async def load_weights(self, path: str) -> None:
        begun = sum(e.endswith("begins") for e in self.events)
        ended = sum(e.endswith("ends") for e in self.events)
        if begun != ended or not self.generating.is_set() or not begun:
            raise RuntimeError(f"loaded {path!r} but could not reset the prefix cache (blocks still in use)")
        self.events.append(f"load {path}")


async def test_a_load_right_after_a_stop_waits_for_the_stopped_jobs_abort() -> None:
    engine = LoadingEngine()
    agent = WorkerAgent(WorkerSettings(worker_id="w", policy_version=3), engine, MemoryStore())  # type: ignore[arg-type]
    await asyncio.wait_for(_stop_when_generating(agent, engine, "d1"), 5)
    assert not agent.runner.tasks and agent.runner._stopped_jobs  # stopped, its abort not yet done
    load = asyncio.create_task(agent.weights.load_policy(pb.LoadPolicy(version=4, weights_path="/w4")))
    await asyncio.sleep(0.05)
    assert not load.done()  # the load waits for the abort
    engine.release.set()
    await asyncio.wait_for(load, 5)
    assert engine.events[-1] == "load /w4" and agent.weights.version == 4
    loaded = [m.policy_loaded for m in sent(agent) if m.WhichOneof("kind") == "policy_loaded"]
    assert [(m.version, m.ok) for m in loaded] == [(4, True)]

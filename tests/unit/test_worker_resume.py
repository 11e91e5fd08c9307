"""A request the scheduler moves (``scheduler/core/moves.py``) on the worker's side
(``worker/resume.py``, ``WorkerAgent``): stopped with ``Abort.keep_partial`` it sends what it
generated; assigned with ``resume`` it goes on from there and returns the whole response."""

from __future__ import annotations

import asyncio

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common import codec as cv
from bubblespec.common.rules import resume_seed
from bubblespec.common.types import Completion, FinishReason, Provenance, SourceStats
from bubblespec.store import DraftEntry, DraftSource, prompt_key
from bubblespec.store.memory import MemoryStore
from bubblespec.worker.agent import WorkerAgent
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.engine import EngineInfo, EngineOutput, EngineRequest

PROMPT = (5, 6, 7)


class ScriptedEngine:
    """Makes token 10 + i (logprob -0.5, text "t{i}") up to ``make`` tokens, then waits to be
    stopped, or ends there when ``finish``; ``abort`` reports the passes and drafts so far."""

    def __init__(self, make: int, finish: bool) -> None:
        self.info = EngineInfo("m", 64, 64, True, "processed")
        self.make, self.finish = make, finish
        self.requests: list[EngineRequest] = []
        self.waiting = asyncio.Event()
        self.dead = False

    async def progress(self, request: EngineRequest, tokens: list, logprobs: list, text: list):
        """The progress outputs, over live lists as ``VllmEngine.generate`` yields them."""
        self.requests.append(request)
        for i in range(self.make):
            tokens.append(10 + i)
            logprobs.append(-0.5)
            text.append(f"t{i}")
            yield EngineOutput(request.key, tokens, logprobs, text)

    async def generate(self, request: EngineRequest):
        tokens: list[int] = []
        logprobs: list[float] = []
        text: list[str] = []
        async for out in self.progress(request, tokens, logprobs, text):
            yield out
        if not self.finish:
            self.waiting.set()
            await asyncio.Event().wait()
        yield EngineOutput(request.key, tuple(tokens), tuple(logprobs), "".join(text), FinishReason.STOP,
                           Provenance(2, (SourceStats("future", 3, 2),)))

    async def abort(self, key: str) -> Provenance:
        return Provenance(2, (SourceStats("future", 9, 7),))  # 7 accepted: more than the 6 tokens it sent


def _assign(resume: Completion | None = None) -> pb.SchedulerMessage:
    a = pb.Assignment(request_key="s/p0/1", step_id="s", prompt_id="p0", sample_index=1, prompt_token_ids=list(PROMPT),
                      sampling=pb.SamplingParams(temperature=1.0, max_tokens=16, seed=7), policy_version=0,
                      use_drafts=True, group_size=2)
    if resume is not None:
        a.resume.CopyFrom(cv.completion_to_pb(resume))
    return pb.SchedulerMessage(assign=a)


def _sent(agent: WorkerAgent, kind: str) -> list:
    out = []
    while not agent.link.outbox.empty():
        msg = agent.link.outbox.get_nowait()
        if msg is not None and msg.WhichOneof("kind") == kind:
            out.append(getattr(msg, kind))
    return out


async def test_a_request_stopped_to_move_sends_what_it_generated() -> None:
    engine = ScriptedEngine(make=6, finish=False)
    agent = WorkerAgent(WorkerSettings(worker_id="w"), engine, MemoryStore())  # type: ignore[arg-type]
    await agent.handle(_assign())
    await asyncio.wait_for(engine.waiting.wait(), 5)
    await agent.handle(pb.SchedulerMessage(abort=pb.Abort(request_key="s/p0/1", keep_partial=True)))
    (aborted,) = _sent(agent, "aborted")
    p = cv.completion_from_pb(aborted.partial)
    assert aborted.request_key == "s/p0/1" and aborted.HasField("partial")
    assert p.token_ids == tuple(range(10, 16)) and p.logprobs == (-0.5,) * 6 and p.text == "t0t1t2t3t4t5"
    assert (p.step_id, p.prompt_id, p.sample_index, p.prompt_tokens) == ("s", "p0", 1, 3)
    # the engine counted 7 accepted draft tokens, one of them in a pass after the last output: kept to the 6 sent
    assert p.provenance.accepted() == 6 and p.provenance.forward_passes + p.provenance.accepted() == 6
    assert "s/p0/1" not in agent.runner.tasks


async def test_a_plain_abort_sends_nothing_and_a_stop_for_a_finished_request_is_a_no_op() -> None:
    engine = ScriptedEngine(make=6, finish=False)
    agent = WorkerAgent(WorkerSettings(worker_id="w"), engine, MemoryStore())  # type: ignore[arg-type]
    await agent.handle(_assign())
    await asyncio.wait_for(engine.waiting.wait(), 5)
    await agent.handle(pb.SchedulerMessage(abort=pb.Abort(request_key="s/p0/1")))
    assert not _sent(agent, "aborted")
    await agent.handle(pb.SchedulerMessage(abort=pb.Abort(request_key="s/p0/9", keep_partial=True)))
    assert not _sent(agent, "aborted") and not agent.runner._keep_partial


async def test_a_moved_request_goes_on_from_its_partial_and_returns_the_whole_response() -> None:
    store = MemoryStore()
    draft = tuple(range(10, 22))  # a stored draft of the whole response: shifted to where it goes on
    await store.put_draft(prompt_key(PROMPT), DraftEntry(draft, 0, "s0", DraftSource.HISTORY, 0.0))
    engine = ScriptedEngine(make=4, finish=True)
    agent = WorkerAgent(WorkerSettings(worker_id="w2"), engine, store)  # type: ignore[arg-type]
    before = Completion("s", "p0", 1, (10, 11, 12, 13, 14, 15), (-0.25,) * 6, "abcdef", FinishReason.STOP, 0, "w",
                        3, Provenance(3, (SourceStats("future", 5, 3),)))
    await agent.handle(_assign(before))
    await asyncio.wait_for(agent.runner.tasks["s/p0/1"], 5)
    (request,) = engine.requests
    assert request.prompt_token_ids == PROMPT + before.token_ids
    assert request.sampling.max_tokens == 10 and request.sampling.seed == resume_seed(7, 6) != 7
    assert dict(request.drafts)["history"] == draft[6:]
    (done,) = _sent(agent, "completion")
    c = cv.completion_from_pb(done.completion)
    assert c.token_ids == before.token_ids + (10, 11, 12, 13) and c.prompt_tokens == 3
    assert c.logprobs == (-0.25,) * 6 + (-0.5,) * 4 and c.text == "abcdeft0t1t2t3"
    assert c.provenance.forward_passes == 5 and c.provenance.accepted("future") == 5
    assert c.provenance.forward_passes + c.provenance.accepted() == len(c.token_ids)


async def test_a_partial_as_long_as_the_request_may_be_is_refused_naming_resume() -> None:
    engine = ScriptedEngine(make=1, finish=True)
    agent = WorkerAgent(WorkerSettings(worker_id="w2"), engine, MemoryStore())  # type: ignore[arg-type]
    before = Completion("s", "p0", 1, tuple(range(16)), (), "", FinishReason.STOP, 0)
    await agent.handle(_assign(before))
    await asyncio.wait_for(agent.runner.tasks["s/p0/1"], 5)
    (aborted,) = _sent(agent, "aborted")
    assert "resume" in aborted.reason and not aborted.HasField("partial") and not engine.requests


class FinishingEngine(ScriptedEngine):
    """As ``VllmEngine.generate``: the final chunk's tokens go into the live lists of the last
    progress output, then the engine awaits the proposer's stats before it yields the final
    output. A stop that lands in that await must send what the last progress output held."""

    def __init__(self) -> None:
        super().__init__(make=6, finish=True)
        self.in_final_await = asyncio.Event()

    async def generate(self, request: EngineRequest):
        tokens: list[int] = []
        logprobs: list[float] = []
        text: list[str] = []
        async for out in self.progress(request, tokens, logprobs, text):
            yield out
        tokens.extend((20, 21, 2))  # the final chunk, ending in EOS
        logprobs.extend((-0.1, -0.1, -0.1))
        text.append("end")
        self.in_final_await.set()
        await asyncio.Event().wait()  # the provenance RPC, stopped here
        yield EngineOutput(request.key, tuple(tokens), tuple(logprobs), "".join(text), FinishReason.STOP,
                           Provenance(len(tokens)))


async def test_a_stop_while_the_engine_finishes_sends_only_what_the_last_progress_output_held() -> None:
    engine = FinishingEngine()
    agent = WorkerAgent(WorkerSettings(worker_id="w"), engine, MemoryStore())  # type: ignore[arg-type]
    await agent.handle(_assign())
    await asyncio.wait_for(engine.in_final_await.wait(), 5)
    await agent.handle(pb.SchedulerMessage(abort=pb.Abort(request_key="s/p0/1", keep_partial=True)))
    (aborted,) = _sent(agent, "aborted")
    p = cv.completion_from_pb(aborted.partial)
    # not the finished response's 9 tokens (with its EOS): a worker going on from those would
    # generate past the response's end
    assert p.token_ids == tuple(range(10, 16)) and p.logprobs == (-0.5,) * 6 and p.text == "t0t1t2t3t4t5"

"""A generation vLLM aborted or that errored is never delivered as a completion.

``VllmEngine.generate`` with a stand-in for vLLM's ``AsyncLLM`` (``_llm``) that yields what
vLLM yields (``RequestOutput``-shaped objects; finish reasons are vLLM's strings, from
``vllm.v1.engine.FINISH_REASON_STRINGS``), and the worker agent around it: the agent answers
``Aborted`` (a failed attempt for the scheduler), and leaves when the engine itself died.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common.types import FinishReason, SamplingParams
from bubblespec.worker.agent import WorkerAgent
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.engine import EngineRequest, EngineSettings, GenerationFailed, VllmEngine


class FakeLLM:
    """Yields two deltas of tokens, the second with ``finish_reason``; ``errored`` as vLLM's."""

    def __init__(self, finish_reason: str, errored: bool = False):
        self.finish_reason = finish_reason
        self.errored = errored

    async def generate(self, prompt, params, request_id):
        yield _output([7, 8], None, finished=False)
        yield _output([9], self.finish_reason, finished=True)

    async def abort(self, request_id):
        pass


def _output(tokens, reason, finished):
    logprobs = [{t: SimpleNamespace(logprob=-0.5)} for t in tokens]
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=logprobs, text="t", finish_reason=reason,
                                                   stop_reason=None)],
                           finished=finished, prompt_logprobs=None, num_cached_tokens=0)


def engine_with(llm: FakeLLM) -> VllmEngine:
    engine = VllmEngine(EngineSettings(model="fake"))
    engine._llm = llm  # type: ignore[assignment]
    engine._params = lambda request: None  # type: ignore[method-assign]  # vLLM's SamplingParams: not needed here
    return engine


REQUEST = EngineRequest("s/p0/0", (5, 6), SamplingParams(temperature=0.0, max_tokens=8))


async def outputs(engine: VllmEngine) -> list:
    return [(tuple(o.token_ids), o.finish_reason) async for o in engine.generate(REQUEST)]


@pytest.mark.parametrize("reason,expected", [("stop", FinishReason.STOP), ("length", FinishReason.LENGTH)])
async def test_finished_generations_are_delivered(reason, expected):
    got = await outputs(engine_with(FakeLLM(reason)))
    assert got[-1] == ((7, 8, 9), expected)


@pytest.mark.parametrize("reason", ["abort", "error", "repetition"])
async def test_aborted_or_errored_generations_raise(reason):
    seen = []
    with pytest.raises(GenerationFailed, match=f"finish reason {reason!r} after 3 tokens"):
        async for out in engine_with(FakeLLM(reason)).generate(REQUEST):
            seen.append(out.finish_reason)
    assert seen == [None], "only progress came out: no final output"


def assignment() -> pb.Assignment:
    return pb.Assignment(request_key="s/p0/0", step_id="s", prompt_id="p0", sample_index=0, prompt_token_ids=[5, 6],
                         sampling=pb.SamplingParams(max_tokens=8), policy_version=0, use_drafts=False, group_size=1)


def sent(agent: WorkerAgent) -> list:
    out = []
    while not agent.link.outbox.empty():
        msg = agent.link.outbox.get_nowait()
        out.append(None if msg is None else msg.WhichOneof("kind"))
    return [m for m in out if m != "heartbeat"]


async def test_agent_reports_an_aborted_generation_and_stays_while_the_engine_lives():
    agent = WorkerAgent(WorkerSettings(worker_id="w"), engine_with(FakeLLM("abort")))
    await agent.runner._run_assignment(assignment())
    msgs = list(agent.link.outbox._queue)  # type: ignore[attr-defined]
    assert sent(agent) == ["aborted"]
    assert "finish reason 'abort'" in msgs[0].aborted.reason and msgs[0].aborted.request_key == "s/p0/0"
    assert agent.failed is None and not agent.link.stopping


async def test_agent_leaves_when_the_engine_died():
    agent = WorkerAgent(WorkerSettings(worker_id="w"), engine_with(FakeLLM("abort", errored=True)))
    await agent.runner._run_assignment(assignment())
    assert sent(agent) == ["aborted", None], "Aborted first, then the stream closes"
    assert isinstance(agent.failed, RuntimeError) and agent.link.stopping
    with pytest.raises(RuntimeError, match="engine died"):
        await asyncio.wait_for(agent.run(), 5)  # run() ends at once with the engine's failure

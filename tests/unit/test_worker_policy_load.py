"""The worker's side of a policy load, without vLLM: what the agent reports and stamps, and
``VllmEngine.load_weights`` over a stand-in for vLLM's ``AsyncLLM`` handle."""

from __future__ import annotations

import pytest

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common.types import FinishReason
from bubblespec.worker.agent import WorkerAgent
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.checkpoint import CheckpointError, read_checkpoint
from bubblespec.worker.engine import EngineInfo, EngineOutput, EngineSettings, VllmEngine
from tests.unit.test_checkpoint import TENSORS, write


class FakeEngine:
    """Loads fail as told; generation returns two tokens."""

    def __init__(self, error: Exception | None = None) -> None:
        self.info = EngineInfo("m", 64, 16, False)
        self.error = error
        self.dead = False

    async def load_weights(self, path: str) -> None:
        if self.error is not None:
            raise self.error

    async def generate(self, request):
        yield EngineOutput(request.key, (3, 4), (0.0, 0.0), "", FinishReason.STOP)

    async def abort(self, key: str) -> None:
        pass


def sent(agent: WorkerAgent) -> list[pb.WorkerMessage]:
    out = []
    while not agent.link.outbox.empty():
        out.append(agent.link.outbox.get_nowait())
    return out


@pytest.mark.parametrize("error, unknown", [(CheckpointError("tensor 'x' is missing"), False),
                                            (RuntimeError("reload failed half way"), True)])
async def test_failed_load_reports_why_and_whether_the_old_weights_still_serve(error, unknown):
    agent = WorkerAgent(WorkerSettings(worker_id="w", policy_version=3), FakeEngine(error))
    await agent.weights.load_policy(pb.LoadPolicy(version=4, weights_path="/w4"))
    [msg] = [m.policy_loaded for m in sent(agent)]
    assert (msg.version, msg.ok, msg.weights_unknown) == (4, False, unknown)
    assert str(error) in msg.error
    assert agent.weights.version == (-1 if unknown else 3)


async def test_completion_carries_the_version_the_engine_loaded():
    agent = WorkerAgent(WorkerSettings(worker_id="w", policy_version=5), FakeEngine(), store=None)
    assign = pb.Assignment(request_key="s/p/0", step_id="s", prompt_id="p", sample_index=0, prompt_token_ids=[1, 2],
                           policy_version=4, sampling=pb.SamplingParams(max_tokens=2))
    await agent.runner._run_assignment(assign)
    [msg] = [m for m in sent(agent) if m.WhichOneof("kind") == "completion"]
    assert msg.completion.completion.policy_version == 5  # what it ran, not what was asked: the scheduler judges


class FakeLLM:
    def __init__(self, reset_ok: bool) -> None:
        self.reset_ok = reset_ok
        self.reloaded: list[str] = []

    async def collective_rpc(self, method: str, kwargs=None, args=()):
        assert method == "reload_weights"
        self.reloaded.append(kwargs["weights_path"])
        return [None]

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.reset_ok


def engine_with(llm: FakeLLM, start) -> VllmEngine:
    engine = VllmEngine(EngineSettings(model=str(start)))
    engine._llm = llm
    engine._expected = read_checkpoint(start)
    return engine


async def test_engine_refuses_a_partial_checkpoint_before_reloading(tmp_path):
    llm = FakeLLM(reset_ok=True)
    engine = engine_with(llm, write(tmp_path / "start"))
    partial = write(tmp_path / "partial", {k: v for k, v in TENSORS.items() if k != "layer.weight"})
    with pytest.raises(CheckpointError, match="'layer.weight' is missing"):
        await engine.load_weights(str(partial))
    with pytest.raises(CheckpointError, match="is not a directory"):
        await engine.load_weights(str(tmp_path / "nowhere"))
    assert llm.reloaded == []  # nothing reached vLLM
    await engine.load_weights(str(write(tmp_path / "good")))
    assert llm.reloaded == [str(tmp_path / "good")]


async def test_engine_fails_the_load_when_the_prefix_cache_could_not_be_reset(tmp_path):
    engine = engine_with(FakeLLM(reset_ok=False), write(tmp_path / "start"))
    with pytest.raises(RuntimeError, match="prefix cache"):
        await engine.load_weights(str(write(tmp_path / "v1")))

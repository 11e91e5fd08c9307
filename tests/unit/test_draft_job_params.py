"""What the worker asks of vLLM per request. A draft job's request skips what only a completion
needs: text and logprobs.

Only its token ids become a draft (``Runner._run_draft``), so detokenizing every token and
building a logprob per token in the engine's frontend was work for nothing, on the same CPU as
the worker's control loop. Stop strings still need the text, so they keep detokenization on.
An assignment's progress comes every 16 tokens, a draft job's every token (``stream_tokens``)."""

from __future__ import annotations

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common.types import FinishReason, Provenance, SamplingParams
from bubblespec.worker.agent import WorkerAgent
from bubblespec.worker.runner import ASSIGNMENT_STREAM_TOKENS
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.engine import EngineInfo, EngineOutput, EngineRequest, EngineSettings, VllmEngine

ENGINE = VllmEngine(EngineSettings(model="unused"))


def test_a_rollout_request_keeps_text_and_logprobs():
    params = ENGINE._params(EngineRequest("s/p0/0", (5, 6), SamplingParams(max_tokens=8)))
    assert params.detokenize is True and params.logprobs == 0


def test_a_draft_job_skips_text_and_logprobs():
    params = ENGINE._params(EngineRequest("draft:d1", (5, 6), SamplingParams(max_tokens=8), draft_job=True))
    assert params.detokenize is False and params.logprobs is None
    assert params.extra_args["bubblespec"]["key"] == "draft:d1"  # still drafted and counted by the proposer


def test_a_draft_job_with_stop_strings_keeps_the_text_they_match_on():
    params = ENGINE._params(EngineRequest("draft:d2", (5, 6), SamplingParams(max_tokens=8, stop=("\n\n",)), draft_job=True))
    assert params.detokenize is True and params.logprobs is None


def test_stream_tokens_become_vllms_stream_interval():
    assert ENGINE._params(EngineRequest("s/p0/0", (5, 6), SamplingParams(max_tokens=8))).stream_interval is None
    params = ENGINE._params(EngineRequest("s/p0/0", (5, 6), SamplingParams(max_tokens=8), stream_tokens=16))
    assert params.stream_interval == 16


class RecordingEngine:
    """Records the requests the agent makes; each ends at once with one token."""

    def __init__(self) -> None:
        self.info = EngineInfo("m", 64, 32, True, "raw_logprobs")
        self.requests: list[EngineRequest] = []

    async def generate(self, request: EngineRequest):
        self.requests.append(request)
        yield EngineOutput(request.key, (7,), (-0.1,), "t", FinishReason.STOP, Provenance(forward_passes=1))


async def test_the_agent_streams_assignments_by_16_tokens_and_draft_jobs_by_every_token():
    engine = RecordingEngine()
    agent = WorkerAgent(WorkerSettings(worker_id="w"), engine)  # type: ignore[arg-type]
    await agent.runner._run_assignment(pb.Assignment(request_key="s/p0/0", step_id="s", prompt_id="p0", prompt_token_ids=[5, 6],
                                              sampling=pb.SamplingParams(max_tokens=8), use_drafts=False, group_size=1))
    await agent.runner._run_draft(pb.DraftJob(job_id="d1", prompt_token_ids=[5, 6], sampling=pb.SamplingParams(max_tokens=8)))
    assert [(r.key, r.draft_job, r.stream_tokens) for r in engine.requests] == [
        ("s/p0/0", False, ASSIGNMENT_STREAM_TOKENS), ("draft:d1", True, 1)]
    assert ASSIGNMENT_STREAM_TOKENS == 16

"""A draft job's vLLM request skips what only a completion needs: text and logprobs.

Only its token ids become a draft (``WorkerAgent._run_draft``), so detokenizing every token and
building a logprob per token in the engine's frontend was work for nothing, on the same CPU as
the worker's control loop. Stop strings still need the text, so they keep detokenization on."""

from __future__ import annotations

from bubblespec.client.types import SamplingParams
from bubblespec.worker.engine import EngineRequest, EngineSettings, VllmEngine

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

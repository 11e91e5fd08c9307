"""The served request fields on their way to vLLM and back, without engines: the wire carries
them, the worker hands them to vLLM's ``SamplingParams`` (seeds modulo 2**64), reads the top
alternatives of each token, keeps them and ``min_tokens`` right across a moved request, gives a
request whose seed a draft job could have no draft job's drafts, and drafts no further than
``min_tokens`` allows."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
from bubblespec.common import codec as cv
from bubblespec.common.rules import DRAFT_SEEDS
from bubblespec.common.types import Completion, FinishReason, Provenance, SamplingParams
from bubblespec.store import DraftEntry, DraftSource, prompt_key
from bubblespec.store.memory import MemoryStore
from bubblespec.worker.agent import WorkerAgent
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.draft_index import Candidate, DraftLength, RequestDrafter
from bubblespec.worker.engine import EngineOutput, EngineRequest, EngineSettings, VllmEngine
from bubblespec.worker.engine_logprobs import top_alternatives as _top
from bubblespec.worker.resume import joined_top_logprobs, partial, resumed

FIELDS = dict(min_tokens=3, include_stop_str_in_output=True, skip_special_tokens=False,
              spaces_between_special_tokens=False, logprobs=4)


def test_the_wire_carries_the_fields_and_wraps_per_sample_seeds_into_int64():
    sp = SamplingParams(max_tokens=8, seed=2**63 + 5, **FIELDS)  # sample 6 of a step seeded 2**63 - 1
    back = cv.sampling_from_pb(cv.sampling_to_pb(sp))
    assert back.seed == 2**63 + 5 - 2**64 and back.seed % 2**64 == sp.seed % 2**64
    assert {k: getattr(back, k) for k in FIELDS} == FIELDS
    assert cv.sampling_from_pb(cv.sampling_to_pb(SamplingParams())) == SamplingParams()  # unset booleans are true
    c = Completion("s", "p0", 0, (1, 2), (-0.5, -0.25), "x", FinishReason.STOP, 1, stop_reason="\n\n",
                   top_logprobs=(((1, -0.5), (3, -1.5)), ((2, -0.25), (4, -2.0))))
    assert cv.completion_from_pb(cv.completion_to_pb(c)) == c
    assert cv.completion_from_pb(cv.completion_to_pb(Completion("s", "p0", 0, (9,), (), "", FinishReason.STOP, 1,
                                                                stop_reason=9))).stop_reason == 9


def test_the_worker_hands_the_fields_to_vllm():
    pytest.importorskip("vllm")
    engine = VllmEngine(EngineSettings(model="unused"))
    params = engine._params(EngineRequest("s/p0/0", (5, 6), SamplingParams(max_tokens=8, seed=-1, **FIELDS)))
    assert (params.min_tokens, params.include_stop_str_in_output, params.skip_special_tokens,
            params.spaces_between_special_tokens, params.logprobs) == (3, True, False, False, 4)
    assert params.seed == 2**64 - 1  # torch's reading of -1; vLLM would take a seed of -1 for none
    assert engine._params(EngineRequest("s/p0/0", (5, 6), SamplingParams(seed=2**63 - 1))).seed == 2**63 - 1
    job = engine._params(EngineRequest("draft:d", (5, 6), SamplingParams(max_tokens=8, **FIELDS), draft_job=True))
    assert job.logprobs is None and job.min_tokens == 3  # a draft job samples as the request will


def test_top_alternatives_are_read_by_rank():
    lp = lambda x, rank: SimpleNamespace(logprob=x, rank=rank)  # noqa: E731
    assert _top({5: lp(-3.0, 7), 1: lp(-0.1, 1), 2: lp(-0.2, 2)}, 2) == ((1, -0.1), (2, -0.2))
    assert _top({2: lp(-0.2, 2), 1: lp(-0.1, 1)}, 2) == ((1, -0.1), (2, -0.2))  # sampled token among them


def test_a_moved_request_keeps_min_tokens_and_its_top_logprobs():
    request = EngineRequest("s/p0/0", (5, 6), SamplingParams(max_tokens=10, seed=3, min_tokens=6, logprobs=1))
    before = Completion("s", "p0", 0, (7, 8), (-0.5, -0.5), "ab", FinishReason.STOP, 0,
                        top_logprobs=(((7, -0.5),), ((9, -0.4),)))
    go_on = resumed(request, before)
    assert (go_on.sampling.max_tokens, go_on.sampling.min_tokens) == (8, 4)
    assert resumed(request, Completion("s", "p0", 0, tuple(range(7)), (), "", FinishReason.STOP, 0)).sampling.min_tokens == 0
    final = EngineOutput("s/p0/0", (1,), (-0.1,), "c", FinishReason.STOP, Provenance(1), 1, (((1, -0.1),),))
    assert joined_top_logprobs(before, final) == (((7, -0.5),), ((9, -0.4),), ((1, -0.1),))
    assert joined_top_logprobs(None, final) == (((1, -0.1),),)
    last = EngineOutput("s/p0/0", [1, 2], [-0.1, -0.2], ["c"], top_logprobs=[((1, -0.1),), ((2, -0.2),)])
    made = partial("s", "p0", 0, before, last, 0, "w", 2, None)
    assert made.token_ids == (7, 8, 1, 2) and len(made.top_logprobs) == 4


async def test_a_request_whose_seed_a_draft_job_could_have_gets_no_draft_jobs_drafts():
    store = MemoryStore()
    prompt = (5, 6, 7)
    await store.put_draft(prompt_key(prompt), DraftEntry((1, 2), 0, "s", DraftSource.FUTURE, 1.0))
    await store.put_draft(prompt_key(prompt), DraftEntry((3, 4), 0, "s", DraftSource.HISTORY, 2.0))
    agent = WorkerAgent(WorkerSettings(), SimpleNamespace(info=None), store)
    everything = {src for src, _ in await agent.runner.drafts_for(prompt, 7)}
    assert everything == {"future", "history"}
    for seed in (DRAFT_SEEDS[0], DRAFT_SEEDS[1] - 1):
        assert {src for src, _ in await agent.runner.drafts_for(prompt, seed)} == {"history"}
    await asyncio.sleep(0)


@pytest.mark.parametrize("min_tokens, generated, most", [(0, 3, 8), (6, 0, 5), (6, 3, 2), (6, 5, 0), (6, 6, 8)])
def test_drafts_stop_short_of_min_tokens(min_tokens, generated, most):
    """vLLM 0.32 masks stop tokens at the position after a request's drafts (the bonus token) by
    the output length before them: the drafts must end before ``min_tokens`` - 1 so that the bonus
    position is still under ``min_tokens`` wherever the output has not reached it."""
    perfect = np.arange(100, 140, dtype=np.int64)
    d = RequestDrafter([Candidate("future", perfect)], DraftLength(max_tokens=8), min_tokens=min_tokens)
    d.accepts = dict.fromkeys(d.accepts, 1.0)  # a draft that was always accepted: the cap decides
    assert len(d.propose(perfect[:generated], cap=8)) == most
    assert len(d.propose(perfect[:generated], cap=8, k=8)) == most  # a length the batch plan decided, too

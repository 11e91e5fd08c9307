"""The scheduler's predicted response length reaches the worker's draft plan.

A batch's plan (``worker/tail_drafts.py``) drafts for the request that ends the batch last. A
request that no draft continues used to be left out of it, so where the longest response had no
draft, the plan took a short drafted one for the last and drafted it deep: every pass of the
long, undrafted response then also verified the short ones' drafts. Now the core sends each
assignment's predicted length (``Assign.predicted_tokens``, the wire's ``predicted_tokens``),
the engine hands it to the proposer, and an undrafted request counts in the plan by it."""

from __future__ import annotations

import numpy as np
from test_core import complete, hello, make_core, of, step
from test_tail_drafts import CPU_TINY_DRAFT_TOKEN, Batch

from bubblespec.common.types import SamplingParams
from bubblespec.scheduler import wire
from bubblespec.scheduler.core.types import Assign, RequestSpec
from bubblespec.worker.engine import EngineRequest, EngineSettings, VllmEngine
from bubblespec.worker.tail_drafts import makespan_draft_tokens


def test_an_undrafted_request_that_ends_last_turns_the_others_drafts_off():
    drafted = makespan_draft_tokens([40, 30, 25], [0.8] * 3, [32] * 3, 0.01, CPU_TINY_DRAFT_TOKEN)
    assert drafted[0] > 0  # alone, the longest drafted request ends the batch: it drafts
    k = makespan_draft_tokens([40, 30, 25, 0], [0.8] * 4, [32] * 4, 0.01, CPU_TINY_DRAFT_TOKEN, [0, 0, 0, 300])
    assert list(k) == [0, 0, 0, 0]  # 300 undrafted tokens end it later whatever the others draft
    k = makespan_draft_tokens([300, 30, 0], [0.8] * 3, [32] * 3, 0.01, CPU_TINY_DRAFT_TOKEN, [0, 0, 100])
    assert k[0] > 0 and k[1] == 0  # a draft that outlasts it still pays, down to the undrafted one's end


def test_the_batch_plan_counts_a_request_without_a_draft_by_its_prediction():
    lengths = [400, 30, 30, 30, 30, 30]
    cover = [0, 30, 30, 30, 30, 30]  # the longest response has no draft
    told = Batch(lengths, makespan=True, cover=cover, predicted=[400, 30, 30, 30, 30, 30])
    blind = Batch(lengths, makespan=True, cover=cover)
    t_told, t_blind = told.run(), blind.run()
    # the short ones end before the long one anyway: drafted only at the first pass (no rate measured yet)
    assert told.drafted <= 5 * 3 < blind.drafted
    assert t_told <= t_blind and told.generated == blind.generated == dict(zip(told.answers, lengths))


def test_the_core_sends_the_predicted_length_with_each_assignment():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=8))
    first = of(core.submit_step(step("s1", 2)), Assign)
    assert [a.predicted_tokens for a in first] == [0.0, 0.0]  # nothing known yet
    for a in first:
        complete(core, a, tokens=12)
    again = of(core.submit_step(step("s2", 2)), Assign)  # the same prompts: their history
    assert [a.predicted_tokens for a in again] == [12.0, 12.0]


def test_the_prediction_travels_on_the_wire_and_into_the_engine_request():
    spec = RequestSpec("s/p0/0", "s", "p0", 0, (5, 6), SamplingParams(max_tokens=8), 3, True, 1)
    single = wire.scheduler_message(Assign("w", spec, 123.5))
    batch = list(wire.scheduler_messages([Assign("w", spec, 7.0), Assign("w", spec, 9.0)], batch=True))
    assert single.assign.predicted_tokens == 123.5
    assert [e.predicted_tokens for e in batch[0].assigns.assignments] == [7.0, 9.0]
    params = VllmEngine(EngineSettings(model="unused"))._params(
        EngineRequest("s/p0/0", (5, 6), SamplingParams(max_tokens=8), predicted_tokens=123.5))
    assert params.extra_args["bubblespec"]["predicted"] == 123.5
    assert np.isclose(single.assign.predicted_tokens, 123.5)

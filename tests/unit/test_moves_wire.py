"""The move messages on the wire (``scheduler/core/moves.py``): ``Abort.keep_partial``,
``Aborted.partial``, ``Assignment.resume`` and ``Hello.accepts_resume``, each way."""

from __future__ import annotations

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common import codec as cv
from bubblespec.common.types import Completion, FinishReason, Provenance, SamplingParams, SourceStats
from bubblespec.scheduler import wire
from bubblespec.scheduler.core.events import Aborted
from bubblespec.scheduler.core.types import Abort, Assign, RequestSpec

PARTIAL = Completion("s", "p0", 0, (7, 8, 9), (-0.5, -0.25, -0.125), "abc", FinishReason.STOP, 3, "w1", 4,
                     Provenance(2, (SourceStats("future", 4, 1),)))


def test_an_abort_asks_for_the_partial_only_when_the_core_moves_the_request():
    assert wire.scheduler_message(Abort("w", "s/p0/0", keep_partial=True)).abort.keep_partial
    plain = wire.scheduler_message(Abort("w", "s/p0/0")).abort
    assert plain.request_key == "s/p0/0" and not plain.keep_partial


def test_the_partial_comes_back_to_the_core_stamped_with_its_sender():
    msg = pb.WorkerMessage(aborted=pb.Aborted(request_key="s/p0/0", reason="moved",
                                              partial=cv.completion_to_pb(PARTIAL)))
    event = wire.worker_event("w2", msg)
    assert isinstance(event, Aborted) and event.key == "s/p0/0"
    assert event.partial is not None and event.partial.token_ids == PARTIAL.token_ids
    assert event.partial.logprobs == PARTIAL.logprobs and event.partial.worker_id == "w2"
    assert event.partial.provenance == PARTIAL.provenance
    without = wire.worker_event("w2", pb.WorkerMessage(aborted=pb.Aborted(request_key="s/p0/0", reason="oom")))
    assert isinstance(without, Aborted) and without.partial is None and without.reason == "oom"


def test_a_moved_request_carries_its_partial_single_and_batched():
    spec = RequestSpec("s/p0/0", "s", "p0", 0, (5, 6), SamplingParams(temperature=1.0, max_tokens=16), 3, True, 1)
    single = wire.scheduler_message(Assign("w", spec, 12.0, PARTIAL)).assign
    assert tuple(single.resume.token_ids) == PARTIAL.token_ids and single.resume.provenance.forward_passes == 2
    assert not wire.scheduler_message(Assign("w", spec, 12.0)).assign.HasField("resume")
    other = RequestSpec("s/p1/0", "s", "p1", 0, (5, 7), spec.sampling, 3, True, 1)
    (batch,) = wire.scheduler_messages([Assign("w", spec, 12.0, PARTIAL), Assign("w", other, 3.0)], batch=True)
    first, second = batch.assigns.assignments
    assert tuple(first.resume.token_ids) == PARTIAL.token_ids and not second.HasField("resume")


def test_the_hello_says_whether_a_worker_can_resume():
    assert pb.Hello(worker_id="w", accepts_resume=True).accepts_resume
    assert not pb.Hello(worker_id="w").accepts_resume

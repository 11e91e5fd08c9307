"""A worker's completion message goes on to the journal and the trainer as received (its worker
id stamped), never encoded again, unless decoding changed it: an unknown finish reason (decoded
as STOP) is encoded anew, and fields this scheduler does not know are dropped."""

from __future__ import annotations

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common import codec as cv
from bubblespec.common.types import FinishReason
from bubblespec.scheduler import wire as wire_module
from bubblespec.scheduler.core.events import Completed


ENCODED: list = []
"""Completions the scheduler encoded (``cv.completion_to_pb`` calls) in the test running."""


class _Recorder:
    """Stands in for ``SchedulerService``: records the events ``wire.feed`` hands it."""

    def __init__(self) -> None:
        self.events: list[Completed] = []

    def on_worker_event(self, event: Completed) -> None:
        self.events.append(event)


def _message(finish: int, extra: bytes = b"") -> pb.WorkerMessage:
    c = pb.Completion(step_id="s", prompt_id="p", token_ids=[7, 8], logprobs=[-0.5, -0.25], finish_reason=finish,
                      worker_id="someone-else", provenance=pb.Provenance(forward_passes=2), prompt_tokens=3)
    wc = pb.WorkerCompletion(request_key="s/p/0")
    wc.completion.MergeFromString(c.SerializeToString() + extra)
    return pb.WorkerMessage(completions=pb.WorkerCompletionBatch(completions=[wc]))


def _fed(msg: pb.WorkerMessage, monkeypatch) -> tuple[Completed, pb.Completion]:
    monkeypatch.setattr(wire_module, "_completion_memo", {})
    encode = cv.completion_to_pb
    monkeypatch.setattr(cv, "completion_to_pb", lambda c: ENCODED.append(c) or encode(c))
    ENCODED.clear()
    service = _Recorder()
    wire_module.feed(service, "w1", pb.WorkerMessage.FromString(msg.SerializeToString()))  # as gRPC parses it
    [event] = service.events
    return event, wire_module.completion_pb(event.completion, keep=True)


def test_the_received_message_is_the_delivered_encoding(monkeypatch):
    event, encoded = _fed(_message(pb.FINISH_REASON_LENGTH), monkeypatch)
    assert event.completion.worker_id == "w1" and event.completion.finish_reason is FinishReason.LENGTH
    assert ENCODED == []  # not encoded again
    assert encoded == cv.completion_to_pb(event.completion)  # what encoding it anew would give
    assert wire_module.completion_pb(event.completion) is encoded  # the trainer's stream takes the same message
    assert wire_module._completion_memo == {}  # taken once


def test_fields_this_scheduler_does_not_know_are_not_passed_on(monkeypatch):
    unknown = bytes([(31 << 3 | 2) & 0x7F | 0x80, (31 << 3 | 2) >> 7, 3]) + b"abc"  # field 31 (not in this proto),
    # length-delimited (its tag a two-byte varint)
    event, encoded = _fed(_message(pb.FINISH_REASON_STOP, unknown), monkeypatch)
    assert ENCODED == [] and b"abc" not in encoded.SerializeToString()
    assert encoded == cv.completion_to_pb(event.completion)


def test_an_unknown_finish_reason_goes_on_as_the_stop_it_was_decoded_as(monkeypatch):
    event, encoded = _fed(_message(77), monkeypatch)
    assert event.completion.finish_reason is FinishReason.STOP
    assert ENCODED == [event.completion] and encoded.finish_reason == pb.FINISH_REASON_STOP
    assert encoded == cv.completion_to_pb(event.completion)

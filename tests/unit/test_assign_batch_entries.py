"""Assignments are built inside the ``assigns`` batch that carries them (``wire.scheduler_messages``):
every entry, including one that did not fit a full batch and so opened the next one, is exactly
the single ``assign`` of its request, in order, and survives the round trip over the wire."""

from __future__ import annotations

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common.types import SamplingParams
from bubblespec.scheduler import wire
from bubblespec.scheduler.core.types import Assign, RequestSpec


def _assign(i: int, length: int = 3) -> Assign:
    spec = RequestSpec(f"s/p{i}/0", "s", f"p{i}", 0, tuple(range(5, 5 + length)),
                       SamplingParams(temperature=0.7, max_tokens=8, seed=i), 3, i % 2 == 0, 4)
    return Assign("w", spec)


def _entries(msgs: list[pb.SchedulerMessage]) -> list[pb.Assignment]:
    out = []
    for m in msgs:
        m = pb.SchedulerMessage.FromString(m.SerializeToString())  # as the worker reads it
        out += list(m.assigns.assignments) if m.WhichOneof("kind") == "assigns" else [m.assign]
    return out


def test_entries_split_by_the_count_cap_are_the_single_assignments(monkeypatch):
    monkeypatch.setattr(wire, "ASSIGN_BATCH_MAX", 2)
    actions = [_assign(i) for i in range(5)]
    msgs = list(wire.scheduler_messages(actions, batch=True))
    assert [m.WhichOneof("kind") for m in msgs] == ["assigns", "assigns", "assign"]
    assert _entries(msgs) == [wire.scheduler_message(a).assign for a in actions]


def test_entries_split_by_the_byte_cap_are_the_single_assignments():
    actions = [_assign(0), _assign(1, length=300), _assign(2), _assign(3)]
    one = wire.scheduler_message(actions[0]).assign.ByteSize() + 6
    msgs = list(wire.scheduler_messages(actions, batch=True, max_bytes=2 * one + 16))
    assert [m.WhichOneof("kind") for m in msgs] == ["assign", "assign", "assigns"]  # the large one overflows alone
    assert _entries(msgs) == [wire.scheduler_message(a).assign for a in actions]

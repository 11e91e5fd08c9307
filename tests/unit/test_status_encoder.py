"""``StatusEncoder`` gives the same document as ``snapshot`` while it reuses encoded timeline
segments: as segments are added and the oldest dropped, as workers come and go, and within
``max_age_seconds`` it hands back the document it built."""

from __future__ import annotations

import json

from bubblespec.scheduler.core.status import StatusEncoder, snapshot
from bubblespec.scheduler.core.types import Assign
from tests.unit.test_core import complete, hello, make_core, of, step


def same(encoder: StatusEncoder, core) -> dict:
    doc = encoder.encode(core)
    expected = json.loads(json.dumps(snapshot(core)))
    assert json.loads(doc.body) == expected
    assert json.loads(json.dumps(doc.view)) == expected | {"workers": [{k: v for k, v in w.items() if k != "timeline"}
                                               for w in expected["workers"]]}
    return expected


def test_encoder_matches_snapshot_as_timelines_grow_wrap_and_workers_change():
    core, clock = make_core(timeline_segments=3)
    encoder = StatusEncoder(max_age_seconds=0.0)
    same(encoder, core)  # no worker
    core.add_worker(hello("a", capacity=1))
    core.add_worker(hello("b", capacity=1))
    same(encoder, core)  # workers with an empty timeline
    for i in range(6):  # each step: busy, then idle; three segments kept per worker, oldest dropped
        clock.now += 1.0
        assigns = of(core.submit_step(step(f"s{i}", 2)), Assign)
        same(encoder, core)
        clock.now += 0.5
        for a in assigns:
            complete(core, a)
        doc = same(encoder, core)
        assert [len(w["timeline"]) for w in doc["workers"]] == [min(3, 2 * i + 2) + 1] * 2
    core.remove_worker("a")
    same(encoder, core)
    core.add_worker(hello("a", capacity=1))  # the same id again: a fresh timeline
    clock.now += 1.0
    doc = same(encoder, core)
    assert [w["worker_id"] for w in doc["workers"]] == ["b", "a"]


def test_document_is_reused_within_max_age():
    core, clock = make_core()
    core.add_worker(hello("a"))
    encoder = StatusEncoder(max_age_seconds=0.5)
    first = encoder.encode(core)
    core.add_worker(hello("b"))
    clock.now += 0.4
    assert encoder.encode(core) is first  # still fresh: the new worker is not in it yet
    current = encoder.encode(core, reuse=False)  # what the Status RPC asks for: built now
    assert [w["worker_id"] for w in current.view["workers"]] == ["a", "b"]
    core.remove_worker("b")
    clock.now += 0.5
    again = encoder.encode(core)
    assert again is not current and [w["worker_id"] for w in again.view["workers"]] == ["a"]

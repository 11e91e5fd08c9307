"""``StallWatch`` (core/balance.py): the core's stall check looks only at requests whose
deadline passed, and still finds exactly those without progress for ``stall`` seconds."""

from __future__ import annotations

from bubblespec.common.types import SamplingParams
from bubblespec.scheduler.core.balance import StallWatch
from bubblespec.scheduler.core.records import RequestState
from bubblespec.scheduler.core.types import RequestSpec


class _Worker:
    def __init__(self, *keys: str):
        self.running = set(keys)


class _Counted(dict):
    """The step's requests, counting look-ups (the check must not touch requests not yet due)."""

    looked = 0

    def get(self, key, default=None):  # type: ignore[no-untyped-def,override]
        self.looked += 1
        return super().get(key, default)


def _req(key: str, worker: str, at: float) -> RequestState:
    step, prompt, i = key.split("/")
    spec = RequestSpec(key, step, prompt, int(i), (1, 2), SamplingParams(max_tokens=8), 0, False, 1)
    return RequestState(spec, worker=worker, started_at=at, progress_at=at)


def test_only_requests_without_progress_for_the_stall_time_are_due() -> None:
    watch = StallWatch()
    reqs = _Counted({k: _req(k, "w0", 0.0) for k in ("s/p/0", "s/p/1", "s/p/2")})
    workers = {"w0": _Worker(*reqs)}
    for k in reqs:
        watch.started("s", k, "w0", 0.0, 30.0)
    reqs["s/p/1"].progress_at = 20.0  # made progress: its deadline moves to 50
    reqs["s/p/2"].done = True  # finished: never due
    assert watch.due("s", reqs, workers, 29.0, 30.0) == []
    assert reqs.looked == 0  # nothing due yet: no request looked at
    assert watch.due("s", reqs, workers, 31.0, 30.0) == [("w0", "s/p/0")]
    assert watch.due("s", reqs, workers, 45.0, 30.0) == []
    assert watch.due("s", reqs, workers, 51.0, 30.0) == [("w0", "s/p/1")]


def test_a_request_assigned_again_is_watched_by_its_new_assignment_only() -> None:
    watch = StallWatch()
    req = _req("s/p/0", "w0", 0.0)
    reqs, workers = {"s/p/0": req}, {"w0": _Worker(), "w1": _Worker("s/p/0")}
    watch.started("s", "s/p/0", "w0", 0.0, 30.0)
    req.worker, req.started_at, req.progress_at = "w1", 10.0, 10.0  # moved to w1 at t=10
    watch.started("s", "s/p/0", "w1", 10.0, 30.0)
    assert watch.due("s", reqs, workers, 35.0, 30.0) == []  # the w0 entry is stale
    assert watch.due("s", reqs, workers, 41.0, 30.0) == [("w1", "s/p/0")]
    watch.forget(set())
    assert watch.due("s", reqs, workers, 100.0, 30.0) == []

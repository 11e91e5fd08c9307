"""The SDK's retry policy: a time budget with capped backoff, reset by progress; hopeless errors not retried."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from bubblespec.api.v1 import rollout_pb2 as pb
from tests.factories import call_client
from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.client import (
    ClientSettings, ResourceExhausted, Retry, SamplingParams,
)


def spend(retry: Retry) -> list[float]:
    """Every delay ``retry`` allows, on a clock that advances by exactly each delay."""
    now = [1000.0]
    out = []
    for delay in retry.delays(clock=lambda: now[0]):
        out.append(delay)
        now[0] += delay
    return out


def test_default_retry_is_a_time_budget_with_capped_backoff():
    delays = spend(Retry())
    assert sum(delays) == pytest.approx(120.0)  # the documented window, whatever the jitter
    assert max(delays) <= 2.0 and len(delays) > 50


def test_attempts_caps_the_count_and_validation():
    assert len(spend(Retry(attempts=3))) == 2
    assert spend(Retry(attempts=1)) == []
    assert sum(spend(Retry(budget_seconds=5, max_seconds=1))) == pytest.approx(5.0)
    with pytest.raises(ValueError):
        Retry(attempts=0, budget_seconds=0)


class Flaky(pbg.RolloutServicer):
    """Generate: one new completion per call, then UNAVAILABLE (the last call finishes the step).
    Announce: RESOURCE_EXHAUSTED, either a size limit or a full scheduler."""

    def __init__(self) -> None:
        self.calls = {"Generate": 0, "Announce": 0}
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            self.calls["Generate"] += 1
            call = self.calls["Generate"]
        n = len(request.prompts)
        for i in range(min(call, n)):
            yield pb.GenerateResponse(completion=pb.Completion(step_id=request.step_id, prompt_id=f"p{i}",
                                                               token_ids=[i]))
        if call < n:
            context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler restarting")
        yield pb.GenerateResponse(summary=pb.StepSummary(step_id=request.step_id, completions=n))

    def Announce(self, request, context):
        with self.lock:
            self.calls["Announce"] += 1
        if request.prompts[0].token_ids.ids[0] == 1:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 4)")
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "step_id: 16 steps are running")


@pytest.fixture
def flaky():
    servicer = Flaky()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pbg.add_RolloutServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(0)


call = call_client


TWINS = pytest.mark.parametrize("kind", ["sync", "async"])


@TWINS
def test_a_stream_that_makes_progress_gets_a_fresh_budget(kind, flaky):
    servicer, target = flaky
    settings = ClientSettings(target=target, retry=Retry(attempts=2, initial_seconds=0.01), step_timeout_seconds=5)
    result = call(kind, settings, "generate", "s", [[5]] * 5, SamplingParams())
    assert servicer.calls["Generate"] == 5, "each broken stream delivered something: no budget was spent"
    assert [c.prompt_id for c in result.completions] == ["p0", "p1", "p2", "p3", "p4"]


@TWINS
def test_a_message_over_the_size_limit_is_not_retried(kind, flaky):
    servicer, target = flaky
    settings = ClientSettings(target=target, retry=Retry(attempts=3, initial_seconds=0.01), timeout_seconds=5)
    with pytest.raises(ResourceExhausted):
        call(kind, settings, "announce", [[1]])
    assert servicer.calls["Announce"] == 1
    with pytest.raises(ResourceExhausted):
        call(kind, settings, "announce", [[2]])  # a full scheduler may have room later: retried
    assert servicer.calls["Announce"] == 1 + 3


@TWINS
def test_retries_stop_when_the_budget_is_spent(kind, flaky):
    servicer, target = flaky
    settings = ClientSettings(target=target, retry=Retry(budget_seconds=0.5, initial_seconds=0.05, max_seconds=0.1),
                              timeout_seconds=5)
    with pytest.raises(ResourceExhausted):
        call(kind, settings, "announce", [[2]])
    assert 3 <= servicer.calls["Announce"] <= 20

"""One suite for both SDK twins, against a scripted Rollout server over real gRPC loopback.

The scripted server fails the first Generate call mid-stream with UNAVAILABLE after two
completions, then replays everything on the retry (as the scheduler does on resume): the
client must return every completion exactly once, in order, and report progress.
"""

from __future__ import annotations

import json
import threading
from concurrent import futures

import grpc
import pytest

from bubblespec.api.v1 import rollout_pb2 as pb
from tests.factories import call_client
from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.client import (
    ClientSettings, InvalidArgument, Retry, SamplingParams, ServiceUnavailable,
)


class ScriptedRollout(pbg.RolloutServicer):
    def __init__(self) -> None:
        self.calls = 0
        self.metadata: list[dict] = []
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            self.calls += 1
            call = self.calls
        self.metadata.append(dict(context.invocation_metadata()))
        if request.sampling.temperature < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature: must be a finite number >= 0")
        if request.step_id == "never":
            context.abort(grpc.StatusCode.UNAVAILABLE, "no workers")
        comps = [pb.Completion(step_id=request.step_id, prompt_id=p.prompt_id, sample_index=i, token_ids=[j, i],
                               policy_version=request.policy_version)
                 for j, p in enumerate(request.prompts) for i in range(request.sampling.n)]
        for k, c in enumerate(reversed(comps)):  # out of order on purpose
            if call == 1 and k == 2:
                context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler restarting")
            yield pb.GenerateResponse(completion=c)
        yield pb.GenerateResponse(summary=pb.StepSummary(step_id=request.step_id, completions=len(comps)))

    def Status(self, request, context):
        return pb.StatusResponse(json=json.dumps({"policy_version": 7}))

    def UpdatePolicy(self, request, context):
        if request.version <= 0:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "version: must be greater than 0")
        return pb.UpdatePolicyResponse(version=request.version, workers_loaded=3)


@pytest.fixture
def server():
    servicer = ScriptedRollout()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pbg.add_RolloutServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(0)


def call(kind: str, target: str, method: str, *args, **kwargs):
    """Run ``method`` on the sync client or on the async twin; same arguments, same result."""
    settings = ClientSettings(target=target, token="t0ken", retry=Retry(attempts=3, initial_seconds=0.01),
                              timeout_seconds=5, step_timeout_seconds=5)
    return call_client(kind, settings, method, *args, **kwargs)


TWINS = pytest.mark.parametrize("kind", ["sync", "async"])


@TWINS
def test_generate_retries_and_returns_each_completion_once_in_order(kind, server):
    servicer, target = server
    seen = []
    result = call(kind, target, "generate", "s1", [[5, 6], "text prompt", [7]], SamplingParams(max_tokens=4),
                  n=2, policy_version=3, on_progress=lambda done, total: seen.append((done, total)))
    assert servicer.calls == 2
    assert [(c.prompt_id, c.sample_index) for c in result.completions] == [
        (f"p{j}", i) for j in range(3) for i in range(2)]
    assert all(c.policy_version == 3 for c in result.completions)
    assert seen[-1] == (6, 6) and [d for d, _ in seen] == list(range(1, 7))
    assert result.summary.completions == 6
    assert servicer.metadata[0]["authorization"] == "Bearer t0ken"


@TWINS
def test_invalid_argument_is_fatal_and_names_the_field(kind, server):
    servicer, target = server
    with pytest.raises(InvalidArgument) as err:
        call(kind, target, "generate", "s2", [[5]], SamplingParams(temperature=-1.0))
    assert err.value.field == "sampling.temperature" and servicer.calls == 1


@TWINS
def test_retryable_error_gives_up_after_the_retry_budget(kind, server):
    servicer, target = server
    with pytest.raises(ServiceUnavailable):
        call(kind, target, "generate", "never", [[5]])
    assert servicer.calls == 3


@TWINS
def test_unary_calls(kind, server):
    _, target = server
    assert call(kind, target, "status") == {"policy_version": 7}
    assert call(kind, target, "update_policy", 4, "/w") == 3
    from bubblespec.client import PreconditionFailed

    with pytest.raises(PreconditionFailed) as err:
        call(kind, target, "update_policy", 0, "/w")
    assert err.value.field == "version"

"""Malformed SDK arguments: ``InvalidArgument`` naming the field, before any network call.

A table of bad arguments to every trainer-facing method, run on both twins against a loopback
gRPC server that records every call it receives: each row must raise ``InvalidArgument`` whose
message starts with the field it names, and the server must have heard nothing.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.client import (
    AsyncRolloutClient, ClientSettings, InvalidArgument, Prompt, Retry, RolloutClient, SamplingParams, SchedulingPolicy,
)
from bubblespec.client._base import make_generate_request, to_prompts


class Recorder(grpc.GenericRpcHandler):
    """Answers every method UNAVAILABLE and remembers it was called."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def service(self, details):
        self.calls.append(details.method)

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAVAILABLE, "recorder")
        if details.method.endswith("/Generate"):
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


@pytest.fixture(scope="module")
def recorder():
    handler = Recorder()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield handler, f"127.0.0.1:{port}"
    srv.stop(0)


def call(kind: str, target: str, method: str, args: tuple, kwargs: dict):
    settings = ClientSettings(target=target, retry=Retry(attempts=1), timeout_seconds=5, step_timeout_seconds=5)
    if kind == "sync":
        with RolloutClient(settings=settings) as client:
            out = getattr(client, method)(*args, **kwargs)
            return list(out) if method == "stream" else out

    async def run():
        async with AsyncRolloutClient(settings=settings) as client:
            if method == "stream":
                return [c async for c in client.stream(*args, **kwargs)]
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(run())


OK = ([[5, 6]],)


_ROW = itertools.count()


def gen(field: str, *args, **kwargs):
    return pytest.param("generate", ("s1", *(args or OK)), kwargs, field, id=f"generate-{field}-{next(_ROW)}")


def sp(**fields) -> SamplingParams:
    return SamplingParams(**fields)


ROWS: list = []
ROWS += [
    # prompts and lookahead: the shapes a trainer gets wrong
    gen("lookahead[0]", [[5, 6]], lookahead=[["next step text", "another"], ["step after"]]),
    gen("lookahead[0]", [[5, 6]], lookahead=[[[7, 8], [9]], [[10]]]),
    gen("lookahead", [[5, 6]], lookahead=None),
    gen("lookahead", [[5, 6]], lookahead="a single text"),
    gen("lookahead[1].token_ids[0]", [[5, 6]], lookahead=[[7], [None]]),
    gen("prompts[0]", [[[5, 6]]]),
    gen("prompts", None),
    gen("prompts", "a bare text is not a list of prompts"),
    gen("prompts", 5),
    gen("prompts[0]", [None]),
    gen("prompts[0]", [{"text": "hi"}]),
    gen("prompts[0]", [b"bytes"]),
    gen("prompts[1]", [[5], 7]),
    gen("prompts[0].token_ids[0]", [[True, 6]]),
    gen("prompts[0].token_ids[1]", [[5, 6.0]]),
    gen("prompts[0].token_ids[1]", [[5, None]]),
    gen("prompts[0].token_ids[0]", [[2**40]]),
    gen("prompts[0].token_ids[0]", [["5", 6]]),
    gen("prompts[0]", [Prompt("a", text="t", token_ids=(5,))]),
    gen("prompts[0]", [Prompt("a")]),
    gen("prompts[0].prompt_id", [Prompt(7, token_ids=(5,))]),  # type: ignore[arg-type]
    gen("prompts[0].text", [Prompt("a", text=b"t")]),  # type: ignore[arg-type]
    gen("prompts[0].token_ids[0]", [Prompt("a", token_ids=("5",))]),  # type: ignore[arg-type]
    gen("prompts[0].max_tokens", [Prompt("a", token_ids=(5,), max_tokens="8")]),  # type: ignore[arg-type]
    gen("prompts[0].max_tokens", [Prompt("a", token_ids=(5,), max_tokens=2**31)]),
]
ROWS += [
    # step id and version
    pytest.param("generate", (None, [[5]]), {}, "step", id="generate-step-none"),
    pytest.param("generate", (True, [[5]]), {}, "step", id="generate-step-bool"),
    pytest.param("generate", (1.5, [[5]]), {}, "step", id="generate-step-float"),
    gen("policy_version", policy_version=-1),
    gen("policy_version", policy_version="3"),
    gen("policy_version", policy_version=True),
    gen("policy_version", policy_version=None),
    gen("policy_version", policy_version=2**63),
    # sampling
    pytest.param("generate", ("s1", [[5]], None), {}, "sampling", id="generate-sampling-none"),
    pytest.param("generate", ("s1", [[5]], {"temperature": 0}), {}, "sampling", id="generate-sampling-dict"),
    gen("sampling.temperature", [[5]], sp(temperature="0.5")),
    gen("sampling.temperature", [[5]], sp(temperature=True)),
    gen("sampling.temperature", [[5]], sp(temperature=None)),
    gen("sampling.top_p", [[5]], sp(top_p="1")),
    gen("sampling.top_k", [[5]], sp(top_k=1.5)),
    gen("sampling.max_tokens", [[5]], sp(max_tokens="16")),
    gen("sampling.max_tokens", [[5]], sp(max_tokens=2**31)),
    gen("sampling.max_tokens", [[5]], sp(max_tokens=None)),
    gen("sampling.n", [[5]], sp(n=True)),
    gen("sampling.seed", [[5]], sp(seed=1.5)),
    gen("sampling.seed", [[5]], sp(seed=2**64)),
    gen("sampling.seed", [[5]], sp(seed=False)),
    gen("sampling.stop", [[5]], sp(stop="###")),
    gen("sampling.stop", [[5]], sp(stop=None)),
    gen("sampling.stop[1]", [[5]], sp(stop=("a", 1))),
    gen("sampling.stop_token_ids[0]", [[5]], sp(stop_token_ids=(2.0,))),
    gen("sampling.stop_token_ids", [[5]], sp(stop_token_ids=2)),
    gen("sampling.ignore_eos", [[5]], sp(ignore_eos=1)),
    gen("n", n=0),
    gen("n", n=True),
    gen("n", n="2"),
    gen("n", n=-1),
    # switches
    gen("policy", policy="fastest"),
    gen("policy", policy=2),
    gen("drafts", drafts="no"),
    gen("drafts", drafts=None),
    gen("straggler_watch", straggler_watch=1),
    gen("progress", progress="yes"),
    gen("on_progress", on_progress=5),
]
ROWS += [
    pytest.param("stream", ("s1", [[[5]]]), {}, "prompts[0]", id="stream-nested-prompt"),
    pytest.param("stream", ("s1", [[5]]), {"lookahead": [["a", "b"]]}, "lookahead[0]", id="stream-per-step-lookahead"),
    pytest.param("stream", ("s1", [[5]]), {"policy_version": -2}, "policy_version", id="stream-negative-version"),
    pytest.param("stream", ("s1", [[5]], sp(top_k="all")), {}, "sampling.top_k", id="stream-bad-sampling"),
    pytest.param("announce", ([["a", "b"], ["c"]],), {}, "prompts[0]", id="announce-per-step-lists"),
    pytest.param("announce", (None,), {}, "prompts", id="announce-none"),
    pytest.param("announce", ([[5, -0.5]],), {}, "prompts[0].token_ids[1]", id="announce-float-token"),
    pytest.param("announce", ([[5]], None), {}, "sampling", id="announce-sampling-none"),
    pytest.param("announce", ([[5]], sp(max_tokens=1.0)), {}, "sampling.max_tokens", id="announce-float-max-tokens"),
    pytest.param("update_policy", (-1, "/w"), {}, "version", id="update-policy-negative-version"),
    pytest.param("update_policy", ("2", "/w"), {}, "version", id="update-policy-str-version"),
    pytest.param("update_policy", (True, "/w"), {}, "version", id="update-policy-bool-version"),
    pytest.param("update_policy", (2.0, "/w"), {}, "version", id="update-policy-float-version"),
    pytest.param("update_policy", (2, None), {}, "weights_path", id="update-policy-path-none"),
    pytest.param("update_policy", (2, b"/w"), {}, "weights_path", id="update-policy-path-bytes"),
    pytest.param("cancel", (None,), {}, "step", id="cancel-none"),
    pytest.param("cancel", (False,), {}, "step", id="cancel-bool"),
    pytest.param("cancel", (["s1"],), {}, "step", id="cancel-list"),
]


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize(("method", "args", "kwargs", "field"), ROWS)
def test_malformed_argument_names_the_field_before_any_call(kind, method, args, kwargs, field, recorder):
    server, target = recorder
    heard = len(server.calls)
    with pytest.raises(InvalidArgument) as err:
        call(kind, target, method, args, kwargs)
    assert err.value.field == field, err.value.message
    assert err.value.message.startswith(field + ": "), err.value.message
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(server.calls) == heard, f"the SDK called the server: {server.calls[heard:]}"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_well_formed_arguments_reach_the_server(kind, recorder):
    """The control: the recorder answers UNAVAILABLE, which a good call gets to see."""
    from bubblespec.client import ServiceUnavailable

    server, target = recorder
    good = [("generate", ("s1", [[5, 6], (7,), "text", Prompt("x", token_ids=[8])], SamplingParams(stop=["#"])),
             {"n": 2, "lookahead": [[9, 10], "next"], "policy": "queue", "policy_version": 3}),
            ("announce", ([[5], "text"],), {}), ("update_policy", (0, Path("/w")), {}), ("cancel", (17,), {})]
    for method, args, kwargs in good:
        heard = len(server.calls)
        with pytest.raises(ServiceUnavailable):
            call(kind, target, method, args, kwargs)
        assert len(server.calls) == heard + 1, method


def test_request_from_accepted_shapes():
    req = make_generate_request(12, 3, [[5, 6], "text", Prompt("x", token_ids=[8], max_tokens=4)],
                                SamplingParams(stop=["#"], stop_token_ids=[2]), n=2, lookahead=[(9,)],
                                policy=SchedulingPolicy.LONGEST_FIRST)
    assert req.step_id == "12" and req.policy_version == 3 and req.sampling.n == 2
    assert [p.prompt_id for p in req.prompts] == ["p0", "p1", "x"]
    assert list(req.prompts[2].token_ids.ids) == [8] and req.prompts[2].max_tokens == 4
    assert req.prompts[1].text == "text" and list(req.lookahead[0].token_ids.ids) == [9]
    assert req.policy == pb.SCHEDULING_POLICY_LONGEST_FIRST
    assert to_prompts([(1, 2)], "lookahead")[0].token_ids == (1, 2)

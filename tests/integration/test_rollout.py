"""The core service end to end: real scheduler, real vLLM CPU workers, real gRPC, real Redis."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import threading

import grpc
import pytest

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.client import Prompt, SamplingParams, SchedulingPolicy
from bubblespec.worker.engine import EngineRequest
from bubblespec.bench.tiny_model import perturb_weights
from tests.factories import GREEDY, generate_request, raw_generate, token_prompts

pytestmark = pytest.mark.vllm


def version(cluster) -> int:
    return cluster.scheduler.core.version


async def reference_outputs(engine, prompts, sampling=GREEDY) -> list[tuple[int, ...]]:
    async def one(i, p):
        final = None
        async for out in engine.generate(EngineRequest(f"ref-{os.urandom(4).hex()}-{i}", tuple(p), sampling)):
            final = out
        return tuple(final.token_ids)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


@pytest.mark.parametrize("policy", [SchedulingPolicy.STATIC, SchedulingPolicy.QUEUE])
async def test_two_steps_every_completion_exactly_once(cluster, policy):
    n = 3
    for step in range(2):
        ids = token_prompts(10, seed=step + 10 * (policy == SchedulingPolicy.QUEUE))
        max_tokens = [8 + 7 * (i % 4) for i in range(len(ids))]  # mixed per-prompt lengths
        prompts = [Prompt(f"q{i}", token_ids=p, max_tokens=m) for i, (p, m) in enumerate(zip(ids, max_tokens))]
        sampling = SamplingParams(temperature=1.0, max_tokens=64, seed=step, ignore_eos=True)
        req = generate_request(f"once-{policy.value}-{step}", prompts, sampling, n=n, policy=policy,
                               policy_version=version(cluster))
        msgs = await raw_generate(cluster.target, req)
        comps = [m.completion for m in msgs if m.WhichOneof("event") == "completion"]
        summaries = [m.summary for m in msgs if m.WhichOneof("event") == "summary"]
        keys = collections.Counter((c.prompt_id, c.sample_index) for c in comps)
        assert set(keys) == {(f"q{i}", s) for i in range(len(ids)) for s in range(n)}
        assert max(keys.values()) == 1, "a completion arrived twice"
        assert len(summaries) == 1 and msgs[-1].WhichOneof("event") == "summary"
        assert summaries[0].completions == len(ids) * n
        for c in comps:
            i = int(c.prompt_id[1:])
            assert c.policy_version == version(cluster)
            assert len(c.token_ids) == max_tokens[i] == len(c.logprobs)
            assert c.finish_reason == pb.FINISH_REASON_LENGTH
            assert c.worker_id in cluster.scheduler.core.workers
        assert {c.worker_id for c in comps} == set(cluster.scheduler.core.workers), "both workers should serve"


async def test_greedy_identical_whatever_policy_or_worker(cluster, client, reference_engine):
    ids = token_prompts(12, seed=7)
    expected = await reference_outputs(reference_engine, ids)
    seen_workers = collections.defaultdict(set)
    for policy in (SchedulingPolicy.STATIC, SchedulingPolicy.QUEUE):
        for drafts in (False, True):
            result = await client.generate(f"greedy-{policy.value}-{drafts}", ids, GREEDY, n=1, policy=policy,
                                           drafts=drafts, policy_version=version(cluster))
            got = [c.token_ids for c in result.completions]
            assert got == expected, f"greedy output changed under {policy.value}, drafts={drafts}"
            for c in result.completions:
                seen_workers[c.prompt_id].add(c.worker_id)
    assert any(len(w) > 1 for w in seen_workers.values()), "no prompt ran on two different workers"


async def test_update_policy_changes_and_restores_greedy_output(cluster, client, tiny_model, tmp_path):
    ids = token_prompts(6, seed=3)
    v0 = version(cluster)
    before = await client.generate("pol-before", ids, GREEDY, policy_version=v0)
    perturbed = perturb_weights(tiny_model, tmp_path / "perturbed", scale=0.05, seed=1)
    assert await client.update_policy(v0 + 1, str(perturbed)) == 2
    changed = await client.generate("pol-changed", ids, GREEDY, policy_version=v0 + 1)
    assert all(c.policy_version == v0 + 1 for c in changed.completions)
    assert [c.token_ids for c in changed.completions] != [c.token_ids for c in before.completions]
    assert await client.update_policy(v0 + 2, tiny_model) == 2
    restored = await client.generate("pol-restored", ids, GREEDY, policy_version=v0 + 2)
    assert [c.token_ids for c in restored.completions] == [c.token_ids for c in before.completions]


async def test_worker_killed_mid_step_loses_and_duplicates_nothing(cluster, tiny_model, tmp_path):
    core = cluster.scheduler.core
    env = dict(os.environ, BUBBLESPEC_LOG_LEVEL="WARNING")
    cmd = [sys.executable, "-m", "bubblespec.cli.main", "worker", "--scheduler", cluster.target,
           "--worker-id", "doomed", "--model", tiny_model, "--max-model-len", "512", "--max-num-seqs", "32",
           "--num-speculative-tokens", "4", "--kv-cache-memory-bytes", str(128 * 2**20), "--metrics-port", "-1"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "worker.log", "wb"))
    try:
        for _ in range(2400):
            if "doomed" in core.workers and core.workers["doomed"].version == core.version:
                break
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            await asyncio.sleep(0.1)
        ids = token_prompts(24, seed=99)
        sampling = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        req = generate_request("killed", ids, sampling, n=2, policy=SchedulingPolicy.STATIC,
                               policy_version=version(cluster))
        # The kill is timed from the moment the scheduler hands the doomed worker its share (a
        # service listener, called before the assignment goes out), by a timer thread, not by this
        # event loop: the loop also runs the shared workers' engine frontends, and under load it
        # once woke so late that the doomed worker had finished its share (nothing to re-queue).
        # 0.1 s in, the worker is mid-generation: its 16 requests of 200 tokens take 200 passes,
        # over 0.4 s at the fastest pass this engine makes.
        killer = threading.Timer(0.1, os.killpg, (proc.pid, signal.SIGKILL))

        def on_assign(action) -> None:
            if killer.ident is None and getattr(action, "worker_id", None) == "doomed" \
                    and getattr(getattr(action, "request", None), "step_id", None) == "killed":
                killer.start()

        cluster.scheduler.service.listeners.append(on_assign)
        try:
            msgs = await asyncio.wait_for(raw_generate(cluster.target, req), 600)
        finally:
            cluster.scheduler.service.listeners.remove(on_assign)
        assert killer.ident is not None, "the doomed worker was handed nothing"
        await asyncio.to_thread(killer.join, 5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    comps = [m.completion for m in msgs if m.WhichOneof("event") == "completion"]
    keys = collections.Counter((c.prompt_id, c.sample_index) for c in comps)
    assert set(keys) == {(f"p{i}", s) for i in range(24) for s in range(2)} and max(keys.values()) == 1
    assert all(len(c.token_ids) == 200 for c in comps)
    summary = msgs[-1].summary
    assert summary.requests_requeued > 0, "the killed worker held work that had to be re-queued"
    assert "doomed" not in core.workers


def _snapshot(cluster) -> tuple:
    core = cluster.scheduler.core
    return (core.version, tuple(core.steps), sum(len(s.completions) for s in core.steps.values()),
            len(core.planner.upcoming), tuple(sorted(core.workers)))


BAD = [
    ("empty batch", dict(prompts=[]), "prompts"),
    ("n = 0", dict(n=0), "sampling.n"),
    ("negative temperature", dict(sampling=SamplingParams(temperature=-0.5, max_tokens=8)), "sampling.temperature"),
    ("top_p above 1", dict(sampling=SamplingParams(top_p=1.5, max_tokens=8)), "sampling.top_p"),
    ("top_p negative", dict(sampling=SamplingParams(top_p=-0.1, max_tokens=8)), "sampling.top_p"),
    ("max_tokens beyond model length", dict(sampling=SamplingParams(max_tokens=10_000)), "sampling.max_tokens"),
    ("prompt longer than model", dict(prompts=[tuple([5] * 600)]), "prompts[0]"),
    ("token id outside vocab", dict(prompts=[(5, 6, 100_000)]), "prompts[0].token_ids[2]"),
    ("negative token id", dict(prompts=[(5, -1)]), "prompts[0].token_ids[1]"),
    ("duplicate prompt ids", dict(prompts=[Prompt("a", token_ids=(5,)), Prompt("a", token_ids=(6,))]),
     "prompts[1].prompt_id"),
    ("unknown policy version", dict(policy_version=987), "policy_version"),
]


@pytest.mark.parametrize("name,override,field", BAD, ids=[b[0] for b in BAD])
async def test_bad_input_is_refused_naming_the_field_and_changes_nothing(cluster, name, override, field):
    before = _snapshot(cluster)
    kw = dict(prompts=[(5, 6, 7)], sampling=SamplingParams(temperature=0.0, max_tokens=8), n=1,
              policy_version=version(cluster))
    kw.update(override)
    wire_n = kw.pop("n") if kw["n"] < 1 else None  # the SDK refuses it itself: put it on the wire by hand
    req = generate_request(f"bad-{abs(hash(name))}", kw.pop("prompts"), kw.pop("sampling"), **kw)
    if wire_n is not None:
        req.sampling.n = wire_n
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw_generate(cluster.target, req)
    expected = grpc.StatusCode.FAILED_PRECONDITION if field == "policy_version" else grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.code() == expected
    assert err.value.details().startswith(field + ":"), err.value.details()
    assert _snapshot(cluster) == before


async def test_reused_step_id_with_other_content_is_refused(cluster, client):
    v = version(cluster)
    first = await client.generate("reuse", [(5, 6, 7)], SamplingParams(temperature=0, max_tokens=4), policy_version=v)
    before = _snapshot(cluster)
    req = generate_request("reuse", [(5, 6, 8)], SamplingParams(temperature=0, max_tokens=4), policy_version=v)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw_generate(cluster.target, req)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and err.value.details().startswith("step_id:")
    assert _snapshot(cluster) == before
    again = await client.generate("reuse", [(5, 6, 7)], SamplingParams(temperature=0, max_tokens=4), policy_version=v)
    assert again.completions == first.completions  # same step id + same content: resumed, not rerun


async def test_update_policy_with_stale_version_is_refused(cluster, client, tiny_model):
    from bubblespec.client import PreconditionFailed

    before = _snapshot(cluster)
    with pytest.raises(PreconditionFailed) as err:  # (the current version and its own path: a retry, answered)
        await client.update_policy(version(cluster) - 1, tiny_model)
    assert err.value.field == "version"
    assert _snapshot(cluster) == before


async def http_json(port: int, path: str) -> dict:
    """GET from the scheduler's HTTP port (in a thread: the server runs on this event loop)."""
    import urllib.request

    def get() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return json.loads(resp.read())

    return await asyncio.to_thread(get)


async def test_status_http_and_rpc_agree(cluster, client):
    rpc = await client.status()
    http = await http_json(cluster.scheduler.http_port, "/status")
    assert rpc["policy_version"] == http["policy_version"] == version(cluster)
    assert {w["worker_id"] for w in http["workers"]} == set(cluster.scheduler.core.workers)
    assert (await http_json(cluster.scheduler.http_port, "/readyz"))["ready"] is True
    assert (await http_json(cluster.scheduler.http_port, "/healthz"))["ok"] is True

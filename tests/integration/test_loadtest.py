"""The load test end to end (real scheduler process, real redis-server, real gRPC, simulated
engines), and the simulated engine itself. No vLLM here: the engine is the simulated one."""

from __future__ import annotations

import asyncio
import math
import shutil

import pytest
from bubblespec.cli.loadtest import (
    LoadSettings,
    memory_verdict,
    percentile,
    run_loadtest,
    summary_text,
)
from bubblespec.common.types import FinishReason, SamplingParams
from bubblespec.scheduler.wire import ASSIGN_BATCH_MAX
from bubblespec.worker.link import BATCH_MAX
from bubblespec.worker.engine import EngineRequest
from bubblespec.bench.load_engine import (
    EOS_TOKEN_ID,
    LoadEngineSettings,
    LoadTestEngine,
)

FAST = LoadEngineSettings(step_seconds=0.001, batch_slope_seconds=0.0, median_tokens=12, progress_tokens=4,
                         vocab_size=1000, max_model_len=128)


async def _final(engine: LoadTestEngine, request: EngineRequest):
    outputs = [out async for out in engine.generate(request)]
    assert all(o.finish_reason is None for o in outputs[:-1])
    return outputs[-1]


@pytest.fixture
async def engine():
    e = LoadTestEngine(FAST)
    await e.start()
    yield e
    await e.shutdown()


async def test_simulated_engine_is_named_and_greedy_is_reproducible(engine):
    assert engine.info.model == "simulated" and engine.info.speculation is False
    other = LoadTestEngine(LoadEngineSettings(**{**FAST.__dict__, "seed": 99}))
    await other.start()
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=64)
        a = await _final(engine, EngineRequest("a", (5, 6, 7), greedy))
        b = await _final(other, EngineRequest("b", (5, 6, 7), SamplingParams(temperature=0.0, max_tokens=64, seed=3)))
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # greedy ignores seeds and engines
        s1 = await _final(engine, EngineRequest("s1", (5, 6, 7), SamplingParams(max_tokens=64, seed=1)))
        s2 = await _final(other, EngineRequest("s2", (5, 6, 7), SamplingParams(max_tokens=64, seed=1)))
        s3 = await _final(engine, EngineRequest("s3", (5, 6, 7), SamplingParams(max_tokens=64, seed=2)))
        assert s1.token_ids == s2.token_ids != s3.token_ids
    finally:
        await other.shutdown()


async def test_simulated_engine_respects_limits(engine):
    long = await _final(engine, EngineRequest("l", (9,) * 10, SamplingParams(max_tokens=40, ignore_eos=True)))
    assert len(long.token_ids) == 40 and long.finish_reason is FinishReason.LENGTH
    assert EOS_TOKEN_ID not in long.token_ids and len(long.logprobs) == 40
    assert long.provenance.forward_passes == 40 and all(lp <= 0 for lp in long.logprobs)
    capped = await _final(engine, EngineRequest("c", (9,) * 120, SamplingParams(max_tokens=100, ignore_eos=True)))
    assert len(capped.token_ids) == 8  # the model length (128) caps max_tokens
    ends = [await _final(engine, EngineRequest(f"e{i}", (i + 3,), SamplingParams(max_tokens=120, seed=i)))
            for i in range(20)]
    stopped = [o for o in ends if o.finish_reason is FinishReason.STOP]
    assert stopped and all(o.token_ids[-1] == EOS_TOKEN_ID for o in stopped)
    assert len({len(o.token_ids) for o in ends}) > 5  # a length distribution, not one length
    first = ends[0].token_ids[0]
    cut = await _final(engine, EngineRequest("st", (3,), SamplingParams(max_tokens=120, seed=0, stop_token_ids=(first,))))
    assert cut.token_ids == (first,) and cut.finish_reason is FinishReason.STOP
    with pytest.raises(ValueError, match="model length"):
        await _final(engine, EngineRequest("big", (1,) * 128, SamplingParams()))


async def test_simulated_engine_batches_and_aborts(engine):
    slow = LoadTestEngine(LoadEngineSettings(**{**FAST.__dict__, "max_num_seqs": 2, "step_seconds": 0.01}))
    await slow.start()
    try:
        sp = SamplingParams(max_tokens=1000 - 1, ignore_eos=True)
        tasks = [asyncio.create_task(_final(slow, EngineRequest(f"r{i}", (4,), sp))) for i in range(3)]
        await asyncio.sleep(0.1)
        assert slow.num_running == 2  # the third waits for a slot
        await slow.abort("r0")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert slow.num_running == 0
        await slow.load_weights("/nowhere/v1")
        assert slow.weights_path == "/nowhere/v1" and slow.loads == 1
    finally:
        await slow.shutdown()


def test_statistics_helpers():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    flat = [100.0, 104.0] + [110.0 + (i % 3) * 0.5 for i in range(18)]
    assert memory_verdict(flat)["verdict"] == "flat"
    growing = [100.0 + 2.0 * i for i in range(20)]
    v = memory_verdict(growing)
    assert v["verdict"] == "grows" and v["slope_mib_per_step"] == pytest.approx(2.0)
    assert memory_verdict(growing[:5])["verdict"].startswith("n/a")


@pytest.mark.timeout(120)
async def test_small_loadtest_delivers_every_completion_once():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    settings = LoadSettings(workers=16, steps=3, prompts=64, samples=2, capacity=2, max_tokens=48,
                            median_tokens=12, step_seconds=0.005, batch_slope_seconds=0.0, worker_processes=2)
    result = await run_loadtest(settings)
    assert result.redis.startswith("redis://")
    per_step = settings.prompts * settings.samples
    assert [r.step for r in result.steps] == [1, 2, 3]
    for r in result.steps:
        assert (r.completions, r.duplicates, r.missing) == (per_step, 0, 0)
        assert r.worker_completions_sent == per_step and r.unmatched_assignments == 0
        assert r.completions_per_second > 0 and r.seconds > 0 and r.generated_tokens > per_step
        assert 0 < r.dispatch_p50_ms <= r.dispatch_p99_ms
        assert 0 < r.refill_p50_ms <= r.refill_p99_ms  # 32 slots for 128 requests: slots get refilled
        assert r.scheduler_rss_mib > 10 and r.scheduler_rss_peak_mib >= r.scheduler_rss_mib * 0.9
        assert r.scheduler_cpu_share > 0 and r.workers_cpu_share > 0  # the agents run in their own processes
    s = result.summary
    assert s["completions"] == s["metrics_completions_total"] == 3 * per_step
    assert s["duplicates"] == s["missing"] == 0 and s["completions_per_second"] > 0
    assert s["worker_store"]["ops"] > 0 and s["redis"]["keys"] > 0
    assert s["reference_ms"] > 0 and f"machine reference {s['reference_ms']:.0f} ms" in summary_text(result)
    assert s["core_probe_ms"] > 0 and f"cores' probe {s['core_probe_ms']:.2f} ms" in summary_text(result)
    # each worker's hello, and every completion in some message; every assignment in some message
    assert s["worker_messages_received"] >= settings.workers + math.ceil(s["completions"] / BATCH_MAX)
    assert s["worker_messages_sent"] >= math.ceil(s["completions"] / ASSIGN_BATCH_MAX)
    assert f"{s['worker_messages_received']:.0f} messages received" in summary_text(result)


@pytest.mark.timeout(120)
async def test_worker_whose_engine_died_leaves_and_its_work_is_done_elsewhere():
    from bubblespec.client import AsyncRolloutClient, Prompt
    from bubblespec.scheduler.server import Scheduler
    from bubblespec.scheduler.settings import SchedulerSettings
    from bubblespec.worker.agent import WorkerAgent, stop_agents
    from bubblespec.worker.settings import WorkerSettings

    sched = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1))
    await sched.start()
    slow = LoadEngineSettings(**{**FAST.__dict__, "step_seconds": 0.02, "median_tokens": 40})
    engines = [LoadTestEngine(slow), LoadTestEngine(slow)]
    for e in engines:
        await e.start()
    agents = [WorkerAgent(WorkerSettings(scheduler=f"127.0.0.1:{sched.grpc_port}", worker_id=f"w{i}",
                                         reconnect_max_seconds=0.2), e) for i, e in enumerate(engines)]
    runs = [asyncio.create_task(a.run()) for a in agents]
    try:
        for _ in range(200):
            if len(sched.core.workers) == 2:
                break
            await asyncio.sleep(0.05)
        prompts = [Prompt(f"p{i}", token_ids=(5, 6, i + 7)) for i in range(16)]
        async with AsyncRolloutClient(f"127.0.0.1:{sched.grpc_port}") as client:
            gen = asyncio.create_task(client.generate("s", prompts, SamplingParams(temperature=0, max_tokens=64),
                                                      policy_version=0))
            for _ in range(200):
                if sched.core.workers["w0"].running:
                    break
                await asyncio.sleep(0.01)
            engines[0].kill()  # its running requests fail, as on a crashed vLLM engine
            with pytest.raises(RuntimeError, match="engine died"):
                await asyncio.wait_for(runs[0], 30)
            result = await asyncio.wait_for(gen, 60)
        assert "w0" not in sched.core.workers, "the worker with a dead engine is still registered"
        assert sorted(c.prompt_id for c in result.completions) == sorted(p.prompt_id for p in prompts)
        assert len(result.completions) == len(prompts)
    finally:
        await stop_agents(agents, runs)
        await sched.stop(grace=0)
        for e in engines:
            await e.shutdown()

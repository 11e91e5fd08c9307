"""``bubblespec loadtest``: the real scheduler and real Redis under N simulated-engine workers.

What runs (docs/LOAD.md has the how-to and a measured run):

- ``redis-server`` on a free local port (unless ``--redis-url`` names one, or ``memory``
  asks for none): the scheduler's step journal and the workers' draft store live there;
- the scheduler in a child process (``python -m bubblespec.cli.loadtest --scheduler-child``):
  the real ``Scheduler`` (gRPC, HTTP, metrics, ticks, journal), alone in its process so that
  /proc/<pid> gives its own memory and CPU;
- N ``WorkerAgent``s in worker processes of their own (``cli/loadtest_workers.py``; one per
  CPU core by default, each hosting a share), each driving a ``LoadTestEngine`` (no model)
  and dialing the scheduler over loopback gRPC like any worker: the load generator neither
  starves the trainer nor shares its event loop;
- the trainer: ``AsyncRolloutClient`` runs S steps, each ``UpdatePolicy`` (the barrier every
  worker passes; on by default) then ``Generate(prompts x samples, lookahead = next step's
  prompts)``. Every step has fresh prompts, as an epoch over a large data set has.

Measured per step:

- completions per second: completions of the step / wall time from sending ``Generate`` to
  receiving the step summary (policy update excluded);
- dispatch latency, per request: from the moment the request became dispatchable on a worker
  until its ``Assignment`` reached that worker's agent. Dispatchable means: the trainer sent
  ``Generate`` (requests that fit the workers' free slots, "first wave"), or, for a request
  that waited for a slot, the worker sent the completion that freed the slot ("refill": the
  worker -> scheduler -> worker round trip). Both ends are read with ``time.monotonic()``, one
  clock for every process of the machine;
- scheduler memory: VmRSS of the scheduler process after the step, and its peak sampled
  every 0.25 s during the step; scheduler CPU seconds in the step.

The memory verdict compares the median RSS of the last five steps with the median of steps
3-7: "flat" when it grew by at most max(4 MiB, 3 %), else "grows". Finished steps are kept by
the scheduler for resume (``CoreSettings.keep_steps``, 32 in the service); the load test keeps
``--keep-steps`` (default 2), and the response lengths of ``--length-history`` prompts (default
8,192; ``CoreSettings.max_length_history``, 200,000 in the service), so that a 20-step run
reaches its steady state.

``--http`` runs the same harness (``started``) under HTTP clients calling ``/v1/completions``
instead of the trainer's steps: ``cli/loadtest_http.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bubblespec.bench.machine import SpeedProbe, mean_of_cores, reference_ms
from bubblespec.cli.loadtest_settings import LoadSettings

__all__ = ["LoadSettings", "add_parser", "common_summary", "finite_json", "format_row", "loadtest", "machine_text",
           "memory_text", "memory_verdict", "percentile", "run_loadtest", "started", "store_lines", "table_header"]

MIB = 2**20


# ----------------------------------------------------------------------------- statistics --


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def memory_verdict(rss_mib: list[float], abs_tolerance_mib: float = 4.0, rel_tolerance: float = 0.03) -> dict:
    """Whether RSS after each step grows: median of the last 5 steps vs median of steps 3-7."""
    if len(rss_mib) < 10:
        return {"verdict": "n/a (needs >= 10 steps)", "growth_mib": math.nan, "slope_mib_per_step": math.nan}
    base = statistics.median(rss_mib[2:7])
    tail = statistics.median(rss_mib[-5:])
    xs = list(range(2, len(rss_mib)))
    ys = rss_mib[2:]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    allowed = max(abs_tolerance_mib, rel_tolerance * base)
    return {"verdict": "flat" if tail - base <= allowed else "grows", "baseline_mib": base, "tail_mib": tail,
            "growth_mib": tail - base, "allowed_mib": allowed, "slope_mib_per_step": slope}


# ------------------------------------------------------------------------------ processes --


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _RedisProcess:
    """A throwaway redis-server without persistence on a free local port."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="bubblespec-loadtest-redis-")
        self._proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> str:
        port = _free_port()
        self._proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
             "--dir", self._dir.name, "--daemonize", "no"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        self.url = f"redis://127.0.0.1:{port}/0"
                        return self.url
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._proc = None
        self._dir.cleanup()


class _SchedulerProcess:
    """The real scheduler in a child process; reads its memory and CPU from /proc."""

    def __init__(self, redis_url: str, keep_steps: int, trace_memory: bool = False,
                 length_history: int = 200_000, keep_alive_seconds: float = 5.0) -> None:
        self._trace = tempfile.NamedTemporaryFile(  # noqa: SIM115 - the child writes it; removed once read
            prefix="bubblespec-loadtest-trace-", suffix=".txt", delete=False)
        self.config = {"redis_url": redis_url, "keep_steps": keep_steps, "length_history": length_history,
                       "keep_alive_seconds": keep_alive_seconds, "trace_file": self._trace.name if trace_memory else ""}
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - the child writes it; removed in stop()
            prefix="bubblespec-loadtest-scheduler-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None
        self.grpc_port = 0
        self.http_port = 0

    async def start(self, timeout: float = 60.0) -> None:
        cmd = [sys.executable, "-m", "bubblespec.cli.loadtest", "--scheduler-child", json.dumps(self.config)]
        self.proc = subprocess.Popen(  # noqa: ASYNC220 - spawning does not wait for the child
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log)
        try:
            line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        except TimeoutError:
            line = b""
        self.proc.stdout.close()
        if not line:
            tail = self.log_tail()
            self.stop()
            raise RuntimeError(f"the scheduler did not start:\n{tail}")
        ports = json.loads(line)
        self.grpc_port, self.http_port = ports["grpc_port"], ports["http_port"]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def rss_mib(self) -> float:
        return self._status_kib("VmRSS") / 1024

    def peak_rss_mib(self) -> float:
        return self._status_kib("VmHWM") / 1024

    def _status_kib(self, name: str) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return float(line.split()[1])
        return math.nan

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def mark_memory(self) -> None:
        """With ``trace_memory``: the child takes the snapshot its end-of-run trace compares with."""
        if self.config["trace_file"] and self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)

    def memory_trace(self) -> str:
        """tracemalloc's top allocation sites, written by the child when it stopped."""
        try:
            return Path(self._trace.name).read_text() if self.config["trace_file"] else ""
        finally:
            Path(self._trace.name).unlink(missing_ok=True)

    def log_tail(self, lines: int = 30) -> str:
        text = Path(self._log.name).read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful: health NOT_SERVING, drain, stop
            try:
                self.proc.wait(300 if self.config["trace_file"] else 20)  # tracemalloc's snapshots take long
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        self._trace.close()
        failed = self.proc is not None and self.proc.returncode not in (0, -signal.SIGTERM)
        if not failed:
            Path(self._log.name).unlink(missing_ok=True)  # kept (and named in the error) otherwise


async def _serve_child(config: dict) -> None:
    """Body of the scheduler child: the real Scheduler, its ports on stdout, SIGTERM to stop."""
    from bubblespec.scheduler.core.settings import CoreSettings
    from bubblespec.scheduler.server import Scheduler
    from bubblespec.scheduler.settings import SchedulerSettings

    settings = SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=0, redis_url=config["redis_url"],
                                 journal_secret=secrets.token_hex(16),  # journal on: part of the measured path
                                 http_keep_alive_seconds=config["keep_alive_seconds"],
                                 core=CoreSettings(keep_steps=config["keep_steps"],
                                                   max_length_history=config["length_history"]))
    scheduler = Scheduler(settings)
    await scheduler.start()
    print(json.dumps({"grpc_port": scheduler.grpc_port, "http_port": scheduler.http_port}), flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    baseline: list = []  # tracemalloc's snapshot when the parent sent SIGUSR1 (after the warm-up rounds)
    if config["trace_file"]:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: baseline.append(_snapshot()))
    await stop.wait()
    if config["trace_file"]:
        _write_trace(config["trace_file"], baseline[-1] if baseline else None)
    await scheduler.stop(grace=5.0)


def _snapshot():
    import gc
    import tracemalloc

    gc.collect()
    return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])


def _write_trace(path: str, baseline=None, top: int = 25) -> None:
    """The largest allocation sites now, and where ``baseline`` (a snapshot after the warm-up
    rounds) was given, the sites that grew most since it."""
    snapshot = _snapshot()
    stats = snapshot.statistics("lineno")
    total = sum(s.size for s in stats)
    lines = [f"traced Python memory: {total / MIB:.1f} MiB in {sum(s.count for s in stats)} blocks"]
    lines += [f"{s.size / MIB:8.2f} MiB {s.count:9d} blocks  {s.traceback[0].filename}:{s.traceback[0].lineno}"
              for s in stats[:top]]
    if baseline is not None:
        diff = snapshot.compare_to(baseline, "lineno")
        grown = sum(d.size_diff for d in diff)
        lines.append(f"grown since the warm-up rounds: {grown / MIB:+.2f} MiB; the sites that grew most:")
        lines += [f"{d.size_diff / MIB:+8.2f} MiB {d.count_diff:+9d} blocks  {d.traceback[0].filename}:"
                  f"{d.traceback[0].lineno}" for d in sorted(diff, key=lambda d: -d.size_diff)[:top]]
    Path(path).write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------ instrumentation --


class _Sampler:
    """Background sampling: the scheduler's RSS peak."""

    def __init__(self, scheduler: _SchedulerProcess) -> None:
        self.scheduler = scheduler
        self.rss_peak = 0.0
        self._task: asyncio.Task | None = None

    def reset(self) -> None:
        self.rss_peak = self.scheduler.rss_mib()

    async def _run(self, period: float = 0.25) -> None:
        while True:
            await asyncio.sleep(period)
            self.rss_peak = max(self.rss_peak, self.scheduler.rss_mib())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


# -------------------------------------------------------------------------------- results --


@dataclass
class StepRecord:
    step: int
    completions: int
    worker_completions_sent: int
    duplicates: int
    missing: int
    seconds: float
    completions_per_second: float
    makespan_seconds: float
    policy_update_seconds: float
    dispatch_p50_ms: float
    dispatch_p99_ms: float
    first_wave_p99_ms: float
    refill_p50_ms: float
    refill_p99_ms: float
    unmatched_assignments: int
    scheduler_rss_mib: float
    scheduler_rss_peak_mib: float
    scheduler_cpu_share: float
    harness_cpu_share: float
    workers_cpu_share: float
    loop_lag_p99_ms: float
    loop_lag_max_ms: float
    generated_tokens: int
    requests_moved: int
    requests_requeued: int
    core_probe_ms: float | None = None
    """How fast the cores ran during the step: the mean over cores of the speed probe's median
    sample (bench/machine.py; lower is faster)."""


@dataclass
class LoadResult:
    settings: dict
    redis: str
    steps: list[StepRecord] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def _step_prompts(settings: LoadSettings, step: int):
    from bubblespec.client import Prompt

    rng = random.Random(f"{settings.seed}/{step}")
    lo, hi = max(1, settings.prompt_tokens // 2), max(1, 3 * settings.prompt_tokens // 2)
    return [Prompt(f"p{i}", token_ids=tuple(rng.randrange(3, 32000) for _ in range(rng.randint(lo, hi))))
            for i in range(settings.prompts)]


def _collector_class():
    from bubblespec.client._base import StepCollector

    class CountingCollector(StepCollector):
        """The SDK's collector, also counting completion messages as they came on the wire."""

        raw = 0

        def _add(self, completion):
            self.raw += 1  # every completion on the wire, alone or in a batch
            return super()._add(completion)

    return CountingCollector


# ------------------------------------------------------------------------------- the run --


class _Harness:
    """Redis, the scheduler process, the simulated workers, and what watches them: the machine
    reference taken before anything started, the cores' speed probe, the scheduler's RSS sampler."""

    def __init__(self, settings: LoadSettings) -> None:
        self.settings = settings
        self.redis: _RedisProcess | None = None
        self.redis_url = ""
        self.scheduler: _SchedulerProcess | None = None
        self.workers = None  # loadtest_workers.WorkerProcesses
        self.memory_trace = ""
        self.latencies: dict[str, list[float]] = {"first": [], "refill": []}  # seconds, all steps
        self.reference_ms = math.nan
        self.speed = SpeedProbe()
        self.sampler: _Sampler | None = None
        self.version = 0  # the cluster's policy version once every worker connected

    async def start(self) -> None:
        from bubblespec.cli.loadtest_workers import WorkerProcesses

        s = self.settings
        if not s.completion_batch_seconds >= 0:
            raise ValueError(f"completion_batch_seconds must be >= 0, got {s.completion_batch_seconds}")
        if s.redis_url == "memory" or (not s.redis_url and shutil.which("redis-server") is None):
            self.redis_url = ""
        elif s.redis_url:
            self.redis_url = s.redis_url
        else:
            self.redis = _RedisProcess()
            self.redis_url = self.redis.start()
        self.scheduler = _SchedulerProcess(self.redis_url, s.keep_steps, s.trace_memory, s.length_history,
                                           s.keep_alive_seconds)
        await self.scheduler.start()
        if s.worker_store not in ("redis", "memory", "none"):
            raise ValueError(f"worker_store must be 'redis', 'memory' or 'none', got {s.worker_store!r}")
        url = self.redis_url if s.worker_store == "redis" else ""
        self.workers = WorkerProcesses(s, self.scheduler.target, url)
        await self.workers.start()

    async def wait_for_workers(self, client, timeout: float = 120.0) -> int:
        deadline = time.monotonic() + timeout
        while True:
            status = await client.status()
            if len(status["workers"]) >= self.settings.workers:
                return int(status["policy_version"])
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(status['workers'])} of {self.settings.workers} workers connected")
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        if self.workers is not None:
            await self.workers.stop()
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)
            self.memory_trace = self.scheduler.memory_trace()
        if self.redis is not None:
            self.redis.stop()


@contextlib.asynccontextmanager
async def started(settings: LoadSettings):
    """A ``_Harness`` for ``settings``: the machine reference taken first, then Redis, the
    scheduler and the worker processes started, every worker connected, the cores' speed probe
    and the RSS sampler running; all of it stopped on the way out (the step and HTTP modes)."""
    from bubblespec.client import AsyncRolloutClient

    h = _Harness(settings)
    h.reference_ms = reference_ms()  # before anything of the test runs: the machine as the test finds it
    try:
        h.speed.start()
        await h.start()
        async with AsyncRolloutClient(h.scheduler.target) as client:
            h.version = await h.wait_for_workers(client)
        h.sampler = _Sampler(h.scheduler)
        h.sampler.start()
        yield h
    finally:
        h.speed.stop()
        if h.sampler is not None:
            await h.sampler.stop()
        await h.stop()


async def _run_step(h: _Harness, client, step: int, version: int, sampler: _Sampler, run_id: str,
                    speed: SpeedProbe | None = None) -> StepRecord:
    from bubblespec.client import SamplingParams, SchedulingPolicy
    from bubblespec.client._base import make_generate_request

    s = h.settings
    update_seconds = 0.0
    if s.update_policy:
        started = time.monotonic()
        await client.update_policy(version, f"/simulated/weights/v{version}")
        update_seconds = time.monotonic() - started
    prompts, ahead = _step_prompts(s, step), _step_prompts(s, step + 1) if step + 1 < s.steps else []
    sampling = SamplingParams(temperature=1.0, max_tokens=s.max_tokens, seed=s.seed * 100_000 + step * s.samples)
    policy = SchedulingPolicy(s.policy)
    step_id = f"{run_id}-s{step}"
    request = make_generate_request(step_id, version, prompts, sampling, s.samples, ahead, policy)
    collector = _collector_class()(request)
    sampler.reset()
    await h.workers.step_started()
    workers_cpu0 = sum(a["cpu"] for a in h.workers.last)
    cpu0, own0 = h.scheduler.cpu_seconds(), time.process_time()
    started = time.monotonic()
    async for _ in client.stream(step_id, prompts, sampling, policy_version=version, n=s.samples,
                                 lookahead=ahead, policy=policy, _collector=collector):
        pass
    ended = time.monotonic()
    seconds = ended - started
    cpu, own = h.scheduler.cpu_seconds() - cpu0, time.process_time() - own0
    probe = await h.workers.collect(started)
    probe["cpu"] -= workers_cpu0
    record = _record(h, step, collector, seconds, update_seconds, (cpu, own), probe, sampler)
    if speed is not None:
        record.core_probe_ms = mean_of_cores(speed.median_ms(started, ended))
    return record


def _record(h: _Harness, step: int, collector, seconds: float, update_seconds: float, cpus: tuple[float, float],
            probe: dict, sampler: _Sampler) -> StepRecord:
    """One step's row; ``cpus``: CPU seconds of the scheduler and of this process in the step;
    ``probe``: the worker processes' numbers (``WorkerProcesses.collect``)."""
    s = h.settings
    h.latencies["first"] += probe["first"]
    h.latencies["refill"] += probe["refill"]
    expected = {(f"p{i}", k) for i in range(s.prompts) for k in range(s.samples)}
    got = set(collector.completions)
    ms = [1000 * x for x in probe["first"] + probe["refill"]]
    summary = collector.summary
    return StepRecord(
        step=step + 1, completions=len(got & expected), worker_completions_sent=probe["sent"],
        duplicates=collector.raw - len(collector.completions),
        missing=len(expected - got) + len(got - expected), seconds=seconds,
        completions_per_second=len(got) / seconds, makespan_seconds=summary.makespan_seconds,
        policy_update_seconds=update_seconds,
        dispatch_p50_ms=percentile(ms, 50), dispatch_p99_ms=percentile(ms, 99),
        first_wave_p99_ms=percentile([1000 * x for x in probe["first"]], 99),
        refill_p50_ms=percentile([1000 * x for x in probe["refill"]], 50),
        refill_p99_ms=percentile([1000 * x for x in probe["refill"]], 99),
        unmatched_assignments=probe["unmatched"],
        scheduler_rss_mib=h.scheduler.rss_mib(), scheduler_rss_peak_mib=sampler.rss_peak,
        scheduler_cpu_share=cpus[0] / seconds, harness_cpu_share=cpus[1] / seconds,
        workers_cpu_share=probe["cpu"] / seconds,
        loop_lag_p99_ms=1000 * percentile(probe["lags"], 99), loop_lag_max_ms=1000 * max(probe["lags"], default=0.0),
        generated_tokens=summary.generated_tokens, requests_moved=summary.requests_moved,
        requests_requeued=summary.requests_requeued)


async def run_loadtest(settings: LoadSettings, on_step=None) -> LoadResult:
    """Run the load test; ``on_step(record)`` is called as each step ends."""
    from bubblespec.client import AsyncRolloutClient

    result = LoadResult(asdict(settings), "")
    async with started(settings) as h:
        result.redis = h.redis_url or "memory (no Redis)"
        async with AsyncRolloutClient(h.scheduler.target) as client:
            version = h.version
            run_id = f"lt{os.getpid():x}{random.getrandbits(16):04x}"
            began = time.monotonic()
            for step in range(settings.steps):
                if settings.update_policy:
                    version += 1
                record = await _run_step(h, client, step, version, h.sampler, run_id, h.speed)
                result.steps.append(record)
                if on_step is not None:
                    on_step(record)
            result.summary = await _summarize(h, result.steps, time.monotonic() - began)
    if h.memory_trace:
        result.summary["scheduler_memory_trace"] = h.memory_trace
    return result


async def _summarize(h: _Harness, steps: list[StepRecord], total_seconds: float) -> dict:
    completions = sum(r.completions for r in steps)
    gen_seconds = sum(r.seconds for r in steps)
    return {
        "completions": completions, "duplicates": sum(r.duplicates for r in steps),
        "missing": sum(r.missing for r in steps), "generate_seconds": gen_seconds,
        "total_seconds": total_seconds, "completions_per_second": completions / gen_seconds,
        "scheduler_cpu_ms_per_completion": 1000 * sum(r.scheduler_cpu_share * r.seconds for r in steps) / completions,
        **_pooled_latencies(h.latencies),
        "dispatch_p50_ms_median_of_steps": statistics.median(r.dispatch_p50_ms for r in steps),
        "dispatch_p99_ms_median_of_steps": statistics.median(r.dispatch_p99_ms for r in steps),
        "dispatch_p99_ms_max_of_steps": max(r.dispatch_p99_ms for r in steps),
        **await common_summary(h, steps),
    }


async def common_summary(h: _Harness, records: list) -> dict:
    """What both modes report at the end, from their per-step or per-round ``records``: the
    scheduler's memory (with the verdict) and counters, the machine's speed, the stores, Redis."""
    rss = [r.scheduler_rss_mib for r in records]
    probed = [r.core_probe_ms for r in records if r.core_probe_ms is not None]
    out = {
        "scheduler_rss_mib_first": rss[0], "scheduler_rss_mib_last": rss[-1],
        "scheduler_peak_rss_mib": h.scheduler.peak_rss_mib(),
        "memory": memory_verdict(rss),
        "worker_store": h.workers.store_stats(),
        **await asyncio.to_thread(_scrape_counts, h.scheduler.http_port),
        "reference_ms": h.reference_ms, "core_probe_ms": statistics.median(probed) if probed else None,
    }
    if h.redis_url:
        out["redis"] = await _redis_info(h.redis_url)
    return out


def _pooled_latencies(lat: dict[str, list[float]]) -> dict:
    """Dispatch latency percentiles over every request of every step (ms)."""
    out = {}
    for name, values in (("dispatch", lat["first"] + lat["refill"]), ("first_wave", lat["first"]),
                         ("refill", lat["refill"])):
        ms = [1000 * v for v in values]
        out.update({f"{name}_p50_ms": percentile(ms, 50), f"{name}_p99_ms": percentile(ms, 99), f"{name}_n": len(ms)})
    return out


def finite_json(value):
    """``value`` with NaN floats replaced by None (strict JSON)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_json(v) for v in value]
    return value


_SCRAPED = {  # summary field <- the scheduler's series (over the whole run: setup and policy updates too)
    "metrics_completions_total": "bubblespec_completions_total",
    "worker_messages_received": 'bubblespec_worker_stream_messages_total{direction="received"}',
    "worker_messages_sent": 'bubblespec_worker_stream_messages_total{direction="sent"}',
    "scheduler_loop_stall_seconds": "bubblespec_scheduler_loop_stall_seconds_total",
}


def _scrape_counts(http_port: int) -> dict[str, float]:
    """The ``_SCRAPED`` series from the scheduler's ``/metrics`` (NaN for one it lacks)."""
    from urllib.request import urlopen

    with urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as resp:
        values = dict(line.rsplit(" ", 1) for line in resp.read().decode().splitlines()
                      if line and not line.startswith("#"))
    return {name: float(values.get(series, math.nan)) for name, series in _SCRAPED.items()}


async def _redis_info(url: str) -> dict:
    from redis.asyncio import Redis

    r = Redis.from_url(url)
    try:
        info = await r.info("memory")
        return {"keys": await r.dbsize(), "used_memory_mib": info["used_memory"] / MIB}
    finally:
        await r.aclose()


# ------------------------------------------------------------------------------- printing --

_COLUMNS = (  # (field, title, width, format)
    ("step", "step", 4, "d"), ("completions", "compl", 6, "d"), ("seconds", "secs", 6, ".2f"),
    ("completions_per_second", "compl/s", 8, ".1f"), ("dispatch_p50_ms", "disp p50 ms", 11, ".2f"),
    ("dispatch_p99_ms", "disp p99 ms", 11, ".2f"), ("refill_p99_ms", "refill p99", 10, ".2f"),
    ("scheduler_rss_mib", "sched RSS MiB", 13, ".1f"), ("scheduler_cpu_share", "sched CPU", 9, ".0%"),
    ("harness_cpu_share", "trainer CPU", 11, ".0%"), ("workers_cpu_share", "workers CPU", 11, ".0%"),
    ("loop_lag_p99_ms", "lag p99 ms", 10, ".1f"),
)


def table_header(columns=_COLUMNS) -> str:
    return "  ".join(f"{title:>{width}}" for _, title, width, _ in columns)


def format_row(r, columns, flags: list[str]) -> str:
    """A record's row: its ``columns`` (``_COLUMNS``' shape), then each non-empty flag as ``!flag``."""
    row = "  ".join(f"{getattr(r, name):>{width}{fmt}}" for name, _, width, fmt in columns)
    return row + "".join(f"  !{f}" for f in flags if f)


def table_row(r: StepRecord) -> str:
    return format_row(r, _COLUMNS, [f"{r.duplicates} dup" if r.duplicates else "",
                                    f"{r.missing} missing" if r.missing else "",
                                    f"{r.requests_moved} moved" if r.requests_moved else "",
                                    f"{r.requests_requeued} requeued" if r.requests_requeued else ""])


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} ms"


def machine_text(s: dict, during: str) -> str:
    return (f"machine reference {s['reference_ms']:.0f} ms, cores' probe {_ms(s.get('core_probe_ms'))} "
            f"during the {during} (bench/machine.py: lower is faster)")


def memory_text(s: dict, unit: str) -> str:
    """The summary's scheduler memory line; ``unit``: step or round."""
    m = s["memory"]
    verdict = m["verdict"]
    if "allowed_mib" in m:
        verdict += (f" (last-5 median {m['growth_mib']:+.1f} MiB vs {unit}s 3-7, allowed {m['allowed_mib']:.1f}; "
                    f"slope {m['slope_mib_per_step']:+.2f} MiB/{unit})")
    return (f"scheduler memory: RSS {s['scheduler_rss_mib_first']:.1f} MiB after {unit} 1, "
            f"{s['scheduler_rss_mib_last']:.1f} MiB after the last, peak {s['scheduler_peak_rss_mib']:.1f} MiB; "
            f"verdict: {verdict}")


def summary_text(result: LoadResult) -> str:
    s = result.summary

    def per(direction: str) -> str:
        return f"{s['worker_messages_' + direction] / s['completions']:.2f}" if s["completions"] else "n/a"

    lines = [
        (f"completions: {s['completions']} delivered, {s['duplicates']} duplicates, {s['missing']} missing or "
         f"unexpected (scheduler's bubblespec_completions_total: {s['metrics_completions_total']:.0f})"),
        (f"throughput: {s['completions_per_second']:.1f} completions/s through the scheduler "
         f"({s['generate_seconds']:.1f} s of Generate, {s['total_seconds']:.1f} s with policy updates); "
         f"scheduler CPU {s['scheduler_cpu_ms_per_completion']:.2f} ms per completion; {machine_text(s, 'steps')}"),
        (f"worker streams: {s['worker_messages_received']:.0f} messages received, "
         f"{s['worker_messages_sent']:.0f} sent over the run, {per('received')} and {per('sent')} per completion "
         f"(a batch counts once; bubblespec_worker_stream_messages_total)"),
        (f"dispatch latency over all {s['dispatch_n']} requests: p50 {s['dispatch_p50_ms']:.2f} ms, "
         f"p99 {s['dispatch_p99_ms']:.2f} ms (first wave, {s['first_wave_n']}: p50 {s['first_wave_p50_ms']:.2f} / "
         f"p99 {s['first_wave_p99_ms']:.2f} ms; refills, {s['refill_n']}: p50 {s['refill_p50_ms']:.2f} / "
         f"p99 {s['refill_p99_ms']:.2f} ms); worst step p99 {s['dispatch_p99_ms_max_of_steps']:.2f} ms"),
        memory_text(s, "step"),
    ]
    return "\n".join(lines + store_lines(result))


def store_lines(result: LoadResult) -> list[str]:
    """The summary's last lines: the workers' draft stores, Redis, the memory trace if taken."""
    s = result.summary
    ws = s["worker_store"]
    lines = [f"worker draft stores ({result.settings['worker_store']}): {ws['ops']} ops, {ws['errors']} errors, "
             f"mean {ws['mean_op_ms']:.2f} ms"]
    if "redis" in s:
        lines.append(f"redis at the end: {s['redis']['keys']} keys, {s['redis']['used_memory_mib']:.1f} MiB")
    if "scheduler_memory_trace" in s:
        lines.append("scheduler allocation sites at the end (tracemalloc):\n" + s["scheduler_memory_trace"])
    return lines


# ------------------------------------------------------------------------------------ CLI --


def add_parser(sub, add) -> None:
    """Register ``loadtest`` on the ``bubblespec`` subparsers; ``add`` is cli.main's flag helper
    (every flag also reads ``BUBBLESPEC_<FLAG>``)."""
    p = sub.add_parser("loadtest", help="load test: real scheduler + Redis under N simulated-engine workers")
    d = LoadSettings()
    for name, help in (("workers", "simulated-engine workers"), ("steps", "rollout steps"),
                       ("prompts", "prompts per step"), ("samples", "samples per prompt"),
                       ("capacity", "concurrent requests per simulated engine"),
                       ("prompt-tokens", "mean prompt length"), ("max-tokens", "max_tokens per request"),
                       ("median-tokens", "median simulated response length"),
                       ("step-seconds", "simulated engine step with one request running"),
                       ("batch-slope-seconds", "extra simulated step time per further running request"),
                       ("keep-steps", "finished steps the scheduler keeps (service default: 4)"),
                       ("length-history", "prompts whose response lengths the scheduler keeps (service: 200000)"),
                       ("policy", "scheduling policy: static | queue | longest-first"),
                       ("update-policy", "push a new policy version before every step"),
                       ("redis-url", "Redis URL ('' = own redis-server if installed, 'memory' = none)"),
                       ("worker-store", "workers' draft store: redis | memory | none"),
                       ("completion-batch-seconds", "the agents' completion window (WorkerSettings)"),
                       ("seed", "seed of prompts and sampling"),
                       ("trace-memory", "tracemalloc in the scheduler; print its top allocation sites (slow)")):
        add(p, name, getattr(d, name.replace("-", "_")), help)
    add(p, "worker-processes", d.worker_processes, "processes hosting the workers (0 = one per CPU core)")
    for name, help in (("http", "HTTP mode: --connections clients call /v1/completions for --rounds rounds instead "
                                "of steps through the SDK (docs/LOAD.md; unless given: --capacity connections x "
                                "choices / workers, and a fast engine, --step-seconds 0.002 --batch-slope-seconds 0 "
                                "--median-tokens 8 --max-tokens 32 --worker-store memory)"),
                       ("connections", "HTTP mode: concurrent connections, one call each per round"),
                       ("rounds", "HTTP mode: rounds"), ("choices", "HTTP mode: choices per call (n)"),
                       ("client-processes", "HTTP mode: processes running the HTTP clients"),
                       ("keep-alive-seconds", "HTTP mode: the scheduler closes a connection idle this long; the "
                                              "clients reopen one idle 3 s less (the service's default: 5)")):
        add(p, name, getattr(d, name.replace("-", "_")), help)
    add(p, "json", "", "also write the results as JSON to this path")


def settings_of(a: argparse.Namespace) -> LoadSettings:
    """The ``LoadSettings`` the command line gave."""
    names = LoadSettings.__dataclass_fields__
    return LoadSettings(**{k: v for k, v in vars(a).items() if k in names})


def loadtest(a: argparse.Namespace) -> int:
    """``bubblespec loadtest``: run, print the table and the summary; exit 1 on lost or duplicate completions."""
    settings = settings_of(a)
    print(f"load test: {settings.workers} simulated-engine workers x capacity {settings.capacity}, "
          f"{settings.steps} steps x {settings.prompts} prompts x {settings.samples} samples", flush=True)
    print(table_header(), flush=True)
    result = asyncio.run(run_loadtest(settings, on_step=lambda r: print(table_row(r), flush=True)))
    print(summary_text(result), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(finite_json(asdict(result)), indent=2))
    return 1 if result.summary["duplicates"] or result.summary["missing"] else 0


if __name__ == "__main__" and sys.argv[1:2] == ["--scheduler-child"]:
    import logging
    import tracemalloc

    if json.loads(sys.argv[2])["trace_file"]:
        tracemalloc.start()

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.environ.get("BUBBLESPEC_LOADTEST_PROFILE"):  # diagnosis: cProfile of the scheduler, written at exit
        import cProfile

        cProfile.run("asyncio.run(_serve_child(json.loads(sys.argv[2])))", os.environ["BUBBLESPEC_LOADTEST_PROFILE"])
    else:
        asyncio.run(_serve_child(json.loads(sys.argv[2])))

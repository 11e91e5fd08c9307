"""What each ``bubblespec`` subcommand runs (settings built from parsed flags)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.store import StoreSettings
from bubblespec.worker.engine import EngineSettings
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.lifeline import exit_after

__all__ = ["demo", "scheduler", "up", "worker", "Cluster"]

logger = logging.getLogger(__name__)
TINY_MODEL_DIR = Path.home() / ".cache" / "bubblespec" / "tiny-model"


def _scheduler_settings(a: argparse.Namespace, **over) -> SchedulerSettings:
    fields = dict(host=a.host, grpc_port=a.grpc_port, http_port=a.http_port, tokenizer=a.tokenizer,
                  served_model_name=getattr(a, "served_model_name", ""),
                  redis_url=a.redis_url, redis_password=a.redis_password, trainer_token=a.trainer_token,
                  worker_token=a.worker_token, tls_cert_file=a.tls_cert_file, tls_key_file=a.tls_key_file,
                  tls_client_ca_file=a.tls_client_ca_file, default_policy=a.default_policy,
                  default_logprobs_mode=a.default_logprobs_mode,
                  redis_tls_ca_file=a.redis_tls_ca_file, orphan_grace_seconds=a.orphan_grace_seconds,
                  http_keep_alive_seconds=a.http_keep_alive_seconds,
                  journal_redis_url=a.journal_redis_url, journal_secret=a.journal_secret,
                  journal_finished_ttl_seconds=a.journal_finished_ttl_seconds,
                  weight_transfer_backend=getattr(a, "weight_transfer_backend", "") or None,
                  weight_update_deadline_seconds=getattr(a, "weight_update_deadline_seconds", 600.0))
    fields.update(over)
    try:
        fields.setdefault("core", CoreSettings(
            spread_samples=a.spread_samples, max_draft_jobs_beside_requests=a.draft_jobs_beside_requests,
            min_requests_beside_draft_jobs=a.min_requests_beside_draft_jobs,
            draft_beside_first_step=a.draft_beside_first_step,
            min_requests_beside_draft_jobs_at_tail=a.min_requests_beside_draft_jobs_at_tail,
            move_long_requests=a.move_long_requests,
            min_tokens_to_move=a.min_tokens_to_move,
            move_to_workers_running_at_most=a.move_to_workers_running_at_most,
            no_worker_timeout_seconds=a.no_worker_timeout_seconds or None))
        return SchedulerSettings(**fields)
    except ValueError as exc:
        raise SystemExit(f"bubblespec: bad scheduler flag: {exc}") from None


def _engine_settings(a: argparse.Namespace) -> EngineSettings:
    """The engine flags as settings; a bad value ends the command with its message (naming the
    setting), not a traceback."""
    try:
        return EngineSettings(model=a.model, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                              num_speculative_tokens=a.num_speculative_tokens, draft_token_budget=a.draft_token_budget,
                              tensor_parallel_size=a.tensor_parallel_size, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
                              enforce_eager=a.enforce_eager,
                              block_size=a.block_size,
                              dtype=a.dtype, cpu_cores=a.cpu_cores, logprobs_mode=a.logprobs_mode,
                              self_suffix_drafting=a.self_suffix_drafting,
                              draft_token_seconds=a.draft_token_seconds, measure_draft_cost=a.measure_draft_cost,
                              draft_for_makespan=a.draft_for_makespan,
                              allow_unsupported_vllm=a.allow_unsupported_vllm, self_checks=not a.unsafe_skip_self_checks,
                              weight_transfer_backend=a.weight_transfer_backend or None,
                              enable_lora=a.enable_lora, max_lora_rank=a.max_lora_rank, max_loras=a.max_loras)
    except ValueError as exc:
        raise SystemExit(f"bubblespec: bad engine flag: {exc}") from None


def ensure_tiny_model(path: Path = TINY_MODEL_DIR) -> str:
    if not (path / "model.safetensors").exists():
        from bubblespec.bench.tiny_model import build_tiny_model

        build_tiny_model(path)
    return str(path)


def scheduler(a: argparse.Namespace) -> None:
    from bubblespec.scheduler.server import run

    run(_scheduler_settings(a))


def _worker_settings(a: argparse.Namespace) -> WorkerSettings:
    if not a.completion_batch_seconds >= 0:
        raise ValueError(f"completion-batch-seconds: must be a number >= 0, got {a.completion_batch_seconds}")
    return WorkerSettings(scheduler=a.scheduler, worker_id=a.worker_id, token=a.worker_token,
                          tls=a.tls, tls_ca_file=a.tls_ca_file, tls_cert_file=a.tls_cert_file,
                          tls_key_file=a.tls_key_file, completion_batch_seconds=a.completion_batch_seconds,
                          engine=_engine_settings(a))


def worker(a: argparse.Namespace) -> int:
    from bubblespec.worker.compat import UnsupportedVllm
    from bubblespec.worker.main import run
    from bubblespec.worker.selfcheck import SelfCheckFailed

    settings = _worker_settings(a)
    store = StoreSettings(url=a.redis_url, password=a.redis_password, tls_ca_file=a.redis_tls_ca_file)
    try:
        run(settings, store, a.metrics_port, a.shutdown_seconds)
    except (UnsupportedVllm, SelfCheckFailed) as exc:
        return _refused("worker", exc)
    return 0


REFUSED_STATUS = 3
"""Exit status of a worker (or ``up``/``demo``) that refused to serve: unsupported vLLM or a
failed start-up self-check."""


def _refused(command: str, exc: Exception, log_path: Path | None = None) -> int:
    print(f"bubblespec {command}: {exc}", file=sys.stderr, flush=True)
    if log_path is not None:
        print(f"its full output is in {log_path}", file=sys.stderr, flush=True)
    return REFUSED_STATUS


def _run_told(command: str, verbose: bool, main, **quiet) -> int:
    """``asyncio.run(main(story))`` under ``quiet_output``: 0, or ``REFUSED_STATUS`` with the
    reason and the log path when the worker's vLLM is unsupported or fails its self-checks."""
    from bubblespec.cli.console import quiet_output
    from bubblespec.worker.compat import UnsupportedVllm
    from bubblespec.worker.selfcheck import SelfCheckFailed

    with quiet_output(command, verbose, **quiet) as story:
        try:
            asyncio.run(main(story))
        except (UnsupportedVllm, SelfCheckFailed) as exc:
            refused = exc
        else:
            return 0
    return _refused(command, refused, story.log_path)


def _preload_vllm() -> None:
    """Import the vLLM modules ``VllmEngine.start`` imports: 10-15 s on a loaded two-core CPU, which
    would stop the event loop if ``start`` did it there. A missing vLLM is left for ``start`` to
    report (with the install hint)."""
    with contextlib.suppress(ImportError):
        from vllm import AsyncEngineArgs  # noqa: F401
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401


def _on_core(settings: EngineSettings, core: int) -> EngineSettings:
    """Pin a CPU engine to one core unless the settings name cores already."""
    from dataclasses import replace

    return settings if settings.cpu_cores else replace(settings, cpu_cores=str(core))


class Cluster:
    """Scheduler + N vLLM workers + one in-process draft store, in this process (``up``).

    The engines start at the same time; if any of them fails to start (or fails its
    self-checks), every engine that did start is shut down and the scheduler stopped before
    ``start`` raises. ``engine_factory`` builds one engine from its settings (default:
    ``VllmEngine``); ``progress`` gets a line when each engine is ready, and after
    ``progress_seconds``, twice that, four times that... while they start."""

    def __init__(self, scheduler: SchedulerSettings, engine: EngineSettings, workers: int,
                 store_settings: StoreSettings = StoreSettings(), engine_factory: Callable | None = None,
                 progress: Callable[[str], None] | None = None, progress_seconds: float = 10.0):
        self.scheduler_settings = scheduler
        self.engine_settings = engine
        self.num_workers = workers
        self.store_settings = store_settings
        self.engine_factory = engine_factory
        self.progress = progress or (lambda line: None)
        self.progress_seconds = progress_seconds
        self.scheduler = None
        self.agents: list = []
        self.engines: list = []
        self._tasks: list[asyncio.Task] = []
        self.self_checked: list[bool] = []  # per engine: the start-up self-checks ran and passed

    async def start(self) -> None:
        from bubblespec.scheduler.server import Scheduler
        from bubblespec.store import open_store
        from bubblespec.worker.agent import WorkerAgent

        self.scheduler = Scheduler(self.scheduler_settings)
        await self.scheduler.start()
        self.store = open_store(self.store_settings, resilient=True)
        target = f"127.0.0.1:{self.scheduler.grpc_port}"
        try:  # self-checks before any agent says hello: an engine that fails them never joins
            await self._start_engines()
        except BaseException:
            try:
                await self._shutdown_engines()  # those that did not start have nothing to shut down
            finally:
                await self.scheduler.stop(grace=0)
            raise
        for i, engine in enumerate(self.engines):
            agent = WorkerAgent(WorkerSettings(scheduler=target, worker_id=f"worker-{i}",
                                               token=self.scheduler_settings.worker_token,
                                               engine=self.engine_settings), engine, self.store)
            self.agents.append(agent)
            self._tasks.append(asyncio.create_task(agent.run()))
        while self.scheduler.core.worker_count < self.num_workers:
            await asyncio.sleep(0.05)

    async def _start_engines(self) -> None:
        """Start every engine at once, then run their self-checks; raise the first failure only
        after every start has ended (so that the caller shuts down all that started)."""
        from bubblespec.cli.console import ticker
        from bubblespec.worker.selfcheck import require_self_checks

        t0 = time.monotonic()

        async def start(i: int, engine) -> None:
            await engine.start()
            self.progress(f"  engine {i + 1}/{self.num_workers} ready after {time.monotonic() - t0:.0f}s")

        tick = asyncio.create_task(ticker(self.progress, "starting engines", self.progress_seconds))
        try:
            factory = self.engine_factory
            if factory is None:
                from bubblespec.worker.engine import VllmEngine

                await asyncio.to_thread(_preload_vllm)  # the scheduler's loop keeps serving meanwhile
                factory = VllmEngine
            cores = sorted(os.sched_getaffinity(0))  # the cores this process may use (a container's cpuset)
            self.engines = [factory(_on_core(self.engine_settings, cores[i % len(cores)])) for i in range(self.num_workers)]
            started = await asyncio.gather(*(start(i, e) for i, e in enumerate(self.engines)), return_exceptions=True)
        finally:
            tick.cancel()
        failed = next((r for r in started if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        self.self_checked = list(await asyncio.gather(*(require_self_checks(e) for e in self.engines)))

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.scheduler.grpc_port}"

    async def stop(self) -> None:
        from bubblespec.worker.agent import stop_agents

        await stop_agents(self.agents, self._tasks)
        if self.scheduler is not None:
            await self.scheduler.stop(grace=1.0)
        await self._shutdown_engines()

    async def _shutdown_engines(self) -> None:
        """Shut every engine down at once; raise the first failure after all of them ended."""
        ended = await asyncio.gather(*(engine.shutdown() for engine in self.engines), return_exceptions=True)
        failed = next((r for r in ended if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed


def _with_model(a: argparse.Namespace, say=None) -> argparse.Namespace:
    if not a.model:
        if say is not None and not (TINY_MODEL_DIR / "model.safetensors").exists():
            say(f"Building the tiny demo model in {TINY_MODEL_DIR} (first run only)...")
        a.model = ensure_tiny_model()
    return a


def _tell_start(story, a: argparse.Namespace) -> None:
    """The first lines of ``up``/``demo``/``bench``: what starts, and where vLLM's output goes."""
    workers = f"{a.workers} vLLM worker{'s' * (a.workers != 1)}"
    story.say(f"Starting a scheduler, an in-process draft store and {workers} in this process (model {a.model});")
    story.say("the engines start in parallel, tens of seconds each on a CPU.")
    if story.log_path is not None:
        story.say(f"vLLM's output goes to {story.log_path} (--verbose shows it here).")


def up(a: argparse.Namespace) -> int:
    async def main(story) -> None:
        started = time.monotonic()
        _with_model(a, story.say)
        _tell_start(story, a)
        cluster = Cluster(_scheduler_settings(a, tokenizer=a.tokenizer or a.model), _engine_settings(a), a.workers,
                          progress=story.say)
        await cluster.start()
        s = cluster.scheduler
        story.say(f"BubbleSpec up: gRPC 127.0.0.1:{s.grpc_port}, HTTP http://127.0.0.1:{s.http_port}/ui, "
                  f"{a.workers} workers (started in {time.monotonic() - started:.0f}s). Ctrl-C to stop.")
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            # bounded: past shutdown_seconds the process exits and its engines die with it
            deadline = exit_after(a.shutdown_seconds, "bubblespec up shutdown")
            await cluster.stop()  # also shuts the vLLM engine processes down
            deadline.cancel()

    return _run_told("up", a.verbose, main, terminal_level=logging.INFO)


def demo(a: argparse.Namespace) -> int:
    from bubblespec.cli.demo import DEMO_MODEL_NOTE, run_demo

    async def main(story) -> None:
        started = time.monotonic()
        random_model = not a.model  # the tiny model, built with random weights
        _with_model(a, story.say)
        _tell_start(story, a)
        settings = SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=0, tokenizer=a.model)
        cluster = Cluster(settings, _engine_settings(a), a.workers, progress=story.say)
        await cluster.start()
        story.say(f"Cluster up in {time.monotonic() - started:.0f}s: {a.workers} vLLM workers, "
                  f"UI at http://127.0.0.1:{cluster.scheduler.http_port}/ui")
        if random_model:
            story.say(DEMO_MODEL_NOTE)
        try:
            await run_demo(cluster, a.prompts, a.samples, say=story.say)
        finally:
            t = time.monotonic()
            await cluster.stop()
            story.say(f"Stopped the cluster in {time.monotonic() - t:.0f}s; the demo took {time.monotonic() - started:.0f}s.")

    return _run_told("demo", a.verbose, main)

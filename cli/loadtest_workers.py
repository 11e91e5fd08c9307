"""The load test's simulated workers, in processes of their own (``bubblespec loadtest``).

Each worker process (``python -m bubblespec.cli.loadtest_workers '<json>'``) hosts a share of
the N ``WorkerAgent``s, each with its own ``LoadTestEngine`` and draft store and its own gRPC
stream to the scheduler, exactly like a deployed worker. The load-test process (the trainer)
talks to them over their stdin/stdout, one JSON line per command and per answer:

- ``{"cmd": "step"}``: a step starts; every slot of every agent is free. Answered once reset,
  before the trainer sends ``Generate``;
- ``{"cmd": "collect", "started": t}``: the step ended (its ``Generate`` was sent at ``t``,
  ``time.monotonic()``): the step's dispatch latencies, completions sent, unmatched
  assignments, event-loop lag and the process's CPU seconds so far, and the draft stores'
  counters;
- ``{"cmd": "stop"}``: stop the agents, engines and stores, answer, exit.

Both ends of a dispatch latency are read with ``time.monotonic()`` (CLOCK_MONOTONIC, one clock
for every process of the machine): the step's start in the trainer process, the slot freed and
the assignment received in the worker process. In the HTTP mode (``cli/loadtest_http.py``) each
engine also records when it took each request and when it finished it, on the same clock
(``TimedEngine``; ``collect`` answers them as ``spans``), so that the load test can take the
engine's time out of an HTTP call's latency.

``ChildProcesses`` is the JSON-lines channel to such processes; the HTTP mode's client processes
use it too.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, replace
from pathlib import Path

__all__ = ["ChildProcesses", "DispatchProbe", "WorkerProcesses", "prompt_key"]


class DispatchProbe:
    """Dispatch latency as the workers see it: free slots (FIFO per worker) vs assignments.

    First-wave slots are free from the step's start, which this process learns only at the
    end (``collect``): their assignments' arrival times are kept and turned into latencies then."""

    def __init__(self) -> None:
        self.free: dict[str, deque[float | None]] = {}
        self.first_at: list[float] = []
        self.refill: list[float] = []
        self.unmatched = 0
        self.completions_sent = 0

    def step_started(self, capacities: dict[str, int]) -> None:
        """Every slot of every worker is free (the previous step has ended) from the step's start on."""
        self.free = {wid: deque([None] * cap) for wid, cap in capacities.items()}
        self.first_at, self.refill = [], []
        self.unmatched = self.completions_sent = 0

    def slot_freed(self, worker_id: str, now: float) -> None:
        self.free.setdefault(worker_id, deque()).append(now)
        self.completions_sent += 1

    def assigned(self, worker_id: str, now: float) -> None:
        slots = self.free.get(worker_id)
        if not slots:
            self.unmatched += 1
            return
        since = slots.popleft()
        if since is None:
            self.first_at.append(now)
        else:
            self.refill.append(now - since)

    def first(self, started: float) -> list[float]:
        """First-wave latencies of a step whose ``Generate`` was sent at ``started``."""
        return [t - started for t in self.first_at]


def prompt_key(token_ids) -> int:
    """The key that pairs an HTTP call with its requests on the engines: the hash of its prompt's
    token ids (a tuple of ints hashes alike in every process: no hash randomisation for ints)."""
    return hash(tuple(token_ids))


def _timed_engine_class():
    from bubblespec.bench.load_engine import LoadTestEngine

    class TimedEngine(LoadTestEngine):
        """A LoadTestEngine that records, for each request it finished, its prompt's key, when
        it took the request and when its final output was ready (``time.monotonic()``), and
        the key of the tokens it made (to check that the right call got them)."""

        def __init__(self, settings, spans: list):
            super().__init__(settings)
            self.spans = spans

        async def generate(self, request):
            took = time.monotonic()
            async for out in super().generate(request):
                if out.finish_reason is not None:
                    self.spans.append((prompt_key(request.prompt_token_ids), took, time.monotonic(),
                                       hash(tuple(out.token_ids))))
                yield out

    return TimedEngine


def _timed_agent_class():
    from bubblespec.worker.agent import WorkerAgent

    class TimedAgent(WorkerAgent):
        """A WorkerAgent that stamps when assignments arrive and when completions leave."""

        def __init__(self, settings, engine, store, probe: DispatchProbe):
            super().__init__(settings, engine, store)
            self.probe = probe
            send = self.link.send

            def timed_send(**kind) -> None:  # everything the worker sends goes through its link
                if "completion" in kind:
                    self.probe.slot_freed(self.worker_id, time.monotonic())
                send(**kind)

            self.link.send = timed_send

        async def handle(self, msg) -> None:
            kind = msg.WhichOneof("kind")
            if kind == "assign":
                self.probe.assigned(self.worker_id, time.monotonic())
            elif kind == "assigns":  # a batch: each assignment arrived now
                now = time.monotonic()
                for _ in msg.assigns.assignments:
                    self.probe.assigned(self.worker_id, now)
            await super().handle(msg)

    return TimedAgent


# ------------------------------------------------------------------------- the child --


class _Workers:
    """The agents of one worker process, their engines, stores and probe."""

    def __init__(self, config: dict) -> None:
        from bubblespec.cli.loadtest_settings import LoadSettings

        self.settings = LoadSettings(**config["settings"])
        self.config = config
        self.probe = DispatchProbe()
        self.agents: list = []
        self.engines: list = []
        self.stores: list = []
        self.tasks: list[asyncio.Task] = []
        self.lags: list[float] = []
        self.spans: list[tuple[int, float, float, int]] = []  # the HTTP mode's TimedEngine records

    async def start(self) -> None:
        from bubblespec.store import StoreSettings, open_store
        from bubblespec.worker.settings import WorkerSettings
        from bubblespec.worker.engine import EngineSettings
        from bubblespec.bench.load_engine import LoadEngineSettings, LoadTestEngine

        s, c = self.settings, self.config
        max_len = s.max_tokens + 2 * s.prompt_tokens + 8
        sim = LoadEngineSettings(step_seconds=s.step_seconds, batch_slope_seconds=s.batch_slope_seconds,
                                max_model_len=max_len, max_num_seqs=s.capacity, median_tokens=s.median_tokens)
        agent_cls = _timed_agent_class()
        timed = _timed_engine_class() if s.http else None
        for i in range(c["first"], c["first"] + c["count"]):
            sim_i = replace(sim, seed=s.seed * 1000 + i)
            engine = LoadTestEngine(sim_i) if timed is None else timed(sim_i, self.spans)
            await engine.start()
            ws = WorkerSettings(scheduler=c["target"], worker_id=f"sim-{i}", completion_batch_seconds=s.completion_batch_seconds,
                                engine=EngineSettings(model="simulated", max_model_len=max_len, max_num_seqs=s.capacity))
            store = None if s.worker_store == "none" else open_store(StoreSettings(url=c["store_url"]), resilient=True)
            if store is not None:
                self.stores.append(store)
            agent = agent_cls(ws, engine, store, self.probe)
            self.engines.append(engine)
            self.agents.append(agent)
            self.tasks.append(asyncio.create_task(agent.run()))
        self.tasks.append(asyncio.create_task(self._lag()))

    async def _lag(self, period: float = 0.05) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(period)
            self.lags.append(time.monotonic() - before - period)

    def answer(self, cmd: dict) -> dict:
        if cmd["cmd"] == "step":
            self.probe.step_started({a.worker_id: self.settings.capacity for a in self.agents})
            self.lags = []
            self.spans.clear()
            return {"ok": True}
        p = self.probe
        stats = [getattr(store, "inner", store).stats for store in self.stores]
        return {"first": p.first(cmd["started"]), "refill": p.refill, "unmatched": p.unmatched,
                "sent": p.completions_sent, "lags": self.lags, "cpu": time.process_time(), "spans": self.spans,
                "store": {"ops": sum(st.ops for st in stats), "errors": sum(st.errors for st in stats),
                          "op_seconds": sum(st.op_seconds_sum for st in stats)}}

    async def stop(self) -> None:
        from bubblespec.worker.agent import stop_agents

        self.tasks[-1].cancel()
        await stop_agents(self.agents, self.tasks)
        for engine in self.engines:
            await engine.shutdown()
        for store in self.stores:
            await store.close()


async def _serve(config: dict) -> None:
    """Body of a worker process: start its agents, then answer commands from stdin."""
    workers = _Workers(config)
    await workers.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ready": True}), flush=True)
    while line := await reader.readline():
        cmd = json.loads(line)
        if cmd["cmd"] == "stop":
            await workers.stop()
            print(json.dumps({"ok": True}), flush=True)
            return
        print(json.dumps(workers.answer(cmd)), flush=True)
    await workers.stop()  # the trainer went away


# ------------------------------------------------------------------------ the parent --


class ChildProcesses:
    """Processes of the load test that answer one JSON line per command on stdout
    (``python -m <module> '<config>'``, one config each; the first line is their ready answer)."""

    def __init__(self, module: str, configs: list[dict], name: str) -> None:
        self.module, self.configs, self.name = module, configs, name
        self.procs: list[asyncio.subprocess.Process] = []
        self._logs = [tempfile.NamedTemporaryFile(  # noqa: SIM115 - the child writes it; removed in stop()
            prefix=f"bubblespec-loadtest-{name}s{k}-", suffix=".log", delete=False) for k in range(len(configs))]
        self.last: list[dict] = []

    async def start(self, timeout: float = 120.0) -> None:
        for config, log in zip(self.configs, self._logs, strict=True):
            self.procs.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", self.module, json.dumps(config),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, limit=2**28))  # a step's latencies: MBs
        try:
            await asyncio.wait_for(asyncio.gather(*(self._read(p) for p in self.procs)), timeout)
        except (TimeoutError, RuntimeError) as exc:
            raise RuntimeError(f"the {self.name} processes did not start ({exc}):\n{self.log_tail()}") from None

    async def _read(self, proc: asyncio.subprocess.Process) -> dict:
        line = await proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} process {proc.pid} exited with {await proc.wait()}")
        return json.loads(line)

    async def call(self, cmd: dict, timeout: float = 60.0) -> list[dict]:
        """Send ``cmd`` to every process; their answers."""
        for proc in self.procs:
            proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        return list(await asyncio.wait_for(asyncio.gather(*(self._read(p) for p in self.procs)), timeout))

    async def stop(self) -> None:
        live = [p for p in self.procs if p.returncode is None]
        for proc in live:
            try:
                proc.stdin.write(b'{"cmd": "stop"}\n')
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass
        for proc in live:
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        failed = any(p.returncode not in (0, None) for p in self.procs)
        for log in self._logs:
            log.close()
            if not failed:
                Path(log.name).unlink(missing_ok=True)  # kept (and named in the error) otherwise

    def log_tail(self, lines: int = 30) -> str:
        tails = []
        for log in self._logs:
            text = Path(log.name).read_text(errors="replace").splitlines()
            tails.append(f"{log.name}:\n" + "\n".join(text[-lines:]))
        return "\n".join(tails)


class WorkerProcesses(ChildProcesses):
    """The load test's worker processes, as the trainer process sees them."""

    def __init__(self, settings, target: str, store_url: str) -> None:
        n = settings.worker_processes or min(settings.workers, os.cpu_count() or 1)
        n = max(1, min(n, settings.workers))
        configs = [{"settings": asdict(settings), "target": target, "store_url": store_url,
                    "first": k * settings.workers // n, "count": (k + 1) * settings.workers // n - k * settings.workers // n}
                   for k in range(n)]
        super().__init__("bubblespec.cli.loadtest_workers", configs, "worker")

    async def step_started(self) -> None:
        await self.call({"cmd": "step"})

    async def collect(self, started: float) -> dict:
        """The step's numbers, merged over the worker processes."""
        self.last = answers = await self.call({"cmd": "collect", "started": started})
        lags = [lag for a in answers for lag in a["lags"]]
        return {"first": [x for a in answers for x in a["first"]], "refill": [x for a in answers for x in a["refill"]],
                "unmatched": sum(a["unmatched"] for a in answers), "sent": sum(a["sent"] for a in answers),
                "cpu": sum(a["cpu"] for a in answers), "lags": lags, "spans": [x for a in answers for x in a["spans"]]}

    def store_stats(self) -> dict:
        ops = sum(a["store"]["ops"] for a in self.last)
        seconds = sum(a["store"]["op_seconds"] for a in self.last)
        return {"ops": ops, "errors": sum(a["store"]["errors"] for a in self.last),
                "mean_op_ms": 1000 * seconds / max(1, ops)}


if __name__ == "__main__":
    import logging

    from bubblespec.scheduler.server import _tune_gc

    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _config = json.loads(sys.argv[1])
    _tune_gc()  # as in the scheduler: dozens of agents allocate several objects per request; fewer young collections
    if os.environ.get("BUBBLESPEC_LOADTEST_WORKER_PROFILE"):  # diagnosis: cProfile of each worker process, at exit
        import cProfile

        cProfile.run("asyncio.run(_serve(_config))", f"{os.environ['BUBBLESPEC_LOADTEST_WORKER_PROFILE']}.{_config['first']}")
    else:
        asyncio.run(_serve(_config))

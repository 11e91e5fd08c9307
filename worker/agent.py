"""The worker agent: one worker process's parts, composed.

A worker is three layers, each the one owner of its state:

- the link (``worker/link.py``): the stream to the scheduler (dial, hello, heartbeats,
  reconnect with backoff) and what goes out on it; the mirror of ``scheduler/wire.py``;
- the runner (``worker/runner.py``): the assignments and draft jobs running on the engine,
  their progress, completions, drafts and moves;
- the weights (``worker/weights.py``): the policy version the engine serves and every change
  to it (policy loads, weight transfer, LoRA adapters, sleep).

``WorkerAgent`` builds them, routes each message from the scheduler to its layer (``handle``),
and answers what the link and the weights ask of the rest of the worker (``link.Peer``,
``weights.Host``). A stream that breaks drops whatever ran (the scheduler re-queues it); an
engine that dies ends ``run()`` with an error, so that the process exits and its supervisor
starts a fresh one.
"""

from __future__ import annotations

import asyncio
import logging

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.store import DraftStore
from bubblespec.worker.engine import Engine
from bubblespec.worker.link import Link
from bubblespec.worker.runner import Runner
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.weights import Weights

__all__ = ["WorkerAgent", "stop_agents"]

logger = logging.getLogger(__name__)


class WorkerAgent:
    """One worker: holds a stream to the scheduler, runs its assignments and draft jobs on an
    ``Engine`` (``VllmEngine``, or the load-test engine), reports progress and completions, and
    writes the drafts and lengths it produces to the draft store (module docstring)."""

    def __init__(self, settings: WorkerSettings, engine: Engine, store: DraftStore | None = None):
        self._settings = settings
        self.worker_id = settings.resolved_id()
        self.engine = engine
        self.failed: Exception | None = None  # set when the engine died: run() raises it
        self.link = Link(settings, self.worker_id, self)
        self.weights = Weights(self.worker_id, engine, self.link, self, settings.policy_version)
        self.runner = Runner(settings, self.worker_id, engine, store, self.link, self.weights, self.check_engine)

    @property
    def settings(self) -> WorkerSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: WorkerSettings) -> None:
        """Settings replaced on a running worker (a test shortens its progress period) reach the
        layers that read them: the link and the runner read theirs as they go."""
        self._settings = self.link.settings = self.runner.settings = settings

    async def run(self) -> None:
        """Serve until ``stop()``, over the link (which re-dials whenever the stream breaks);
        raises the engine's failure if the engine died."""
        await self.link.run()
        if self.failed is not None:
            raise self.failed

    async def stop(self) -> None:
        self.link.close()
        await self.runner.drop_all()
        await self.weights.stop()

    def check_engine(self) -> None:
        """After a failed request: if the engine itself is dead, leave the scheduler (which
        re-queues this worker's work at once) and end ``run()`` with an error, so that the
        process exits and its supervisor (Kubernetes) starts a fresh one."""
        if self.failed is None and self.engine.dead:
            logger.error("worker %s: the inference engine died; leaving the scheduler", self.worker_id)
            self.failed = RuntimeError(f"worker {self.worker_id}: the inference engine died")
            self.link.close()

    async def handle(self, msg: pb.SchedulerMessage) -> None:
        """One message from the scheduler, to the layer it is for."""
        kind = msg.WhichOneof("kind")
        if kind == "assign":
            self.runner.assign(msg.assign)
        elif kind == "assigns":  # each as a single ``assign``; a bad one costs only itself
            for i, a in enumerate(msg.assigns.assignments):
                self.runner.assign(a, f"assigns[{i}]")
        elif kind == "abort":
            await self.runner.abort(msg.abort.request_key, msg.abort.keep_partial)
        elif kind == "load_policy":
            await self.weights.load_policy(msg.load_policy)
        elif kind == "draft_job":
            self.runner.start_draft(msg.draft_job)
        elif kind == "stop_draft":
            self.runner.stop_draft(msg.stop_draft.job_id)
        elif kind == "control":
            self.weights.control(msg.control)

    # ------------------------------------------------- the link's peer (link.Peer) --

    def hello(self) -> pb.Hello:
        info = self.engine.info
        return pb.Hello(worker_id=self.worker_id, capacity=self.settings.engine.max_num_seqs,
                        policy_version=self.weights.version, max_model_len=info.max_model_len,
                        vocab_size=info.vocab_size, model=info.model, speculation=info.speculation,
                        logprobs_mode=info.logprobs_mode, dtype=info.dtype, lora_config=info.lora_config,
                        tensor_parallel_size=self.settings.engine.tensor_parallel_size,
                        accepts_assign_batches=True, accepts_resume=True)

    def heartbeat(self) -> pb.Heartbeat:
        return self.runner.heartbeat()

    async def alongside(self) -> None:
        await self.runner.read_draft_cost()

    async def stream_ended(self) -> None:
        await self.runner.drop_all()

    def requests_running(self) -> bool:
        return self.runner.requests_running()

    async def request_end(self, timeout: float) -> bool:
        return await self.runner.request_end(timeout)

    # --------------------------------------------- the weights' host (weights.Host) --

    def running(self) -> int:
        return len(self.runner.tasks)

    async def drain(self) -> None:
        await self.runner.drop_all()


async def stop_agents(agents: list[WorkerAgent], tasks: list[asyncio.Task]) -> None:
    """Stop agents and wait for their ``run()`` tasks to end."""
    for agent in agents:
        await agent.stop()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

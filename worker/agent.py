"""The worker agent: dials the scheduler, runs assignments and draft jobs on an engine.

One bidirectional stream per worker. The agent reconnects with backoff when the scheduler
goes away; whatever it was running is dropped on reconnect (the scheduler re-queues it).
Completions are written back as history drafts and length history; draft jobs write
``future`` drafts, partial ones included when preempted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common import codec as cv
from bubblespec.common.rules import shares_draft_seeds
from bubblespec.common.types import Completion
from bubblespec.store import DraftEntry, DraftSource, DraftStore, prompt_key
from bubblespec.worker.engine import Engine, EngineRequest
from bubblespec.worker.link import Link
from bubblespec.worker.resume import Yielded, joined, joined_prompt_logprobs, joined_top_logprobs, partial, resumed
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.weights import Weights

__all__ = ["WorkerAgent", "stop_agents"]

logger = logging.getLogger(__name__)
ASSIGNMENT_STREAM_TOKENS = 16
"""An assignment's progress comes from the engine every 16 tokens (``EngineRequest.stream_tokens``):
its progress reports go out every ``progress_seconds`` anyway, and an aborted assignment keeps
nothing. Draft jobs stream every token: a preempted job keeps the tokens it has received."""


DRAFT_PREFIX = "draft:"
"""Prefix of a draft job's key in ``WorkerAgent.tasks`` (and the engine's request key); every
other key there is a request's."""


class WorkerAgent:
    """One worker: holds a stream to the scheduler, runs its assignments and draft jobs on an
    ``Engine`` (``VllmEngine``, or the load-test engine), reports progress and completions, and
    writes the drafts and lengths it produces to the draft store. Reconnects with backoff; what it
    was running when a stream broke is dropped (the scheduler re-queues it)."""

    def __init__(self, settings: WorkerSettings, engine: Engine, store: DraftStore | None = None):
        self.settings = settings
        self.worker_id = settings.resolved_id()
        self.engine = engine
        self.store = store
        self.tasks: dict[str, asyncio.Task] = {}  # request key or draft job id -> task
        self.tokens_window: list[tuple[float, int]] = []
        self.draft_seconds = 0.0
        self.spec_tokens: dict[str, list[int]] = {}  # draft source -> [drafted, accepted], completed requests
        self.draft_token_seconds: float | None = None  # the engine's draft-length rule's figure (None: not read yet)
        self.drafted_request_seconds = 0.0  # its figure for a drafted request beyond its tokens (read with it)
        self.draft_tokens: dict[str, int] = {}  # running draft job id -> tokens generated so far
        self.failed: Exception | None = None  # set when the engine died: run() raises it
        self._stopped_jobs: set[asyncio.Task] = set()  # stopped draft jobs still cleaning up (``_stop_draft``)
        self._request_ended = asyncio.Event()  # set when a request's task leaves ``tasks`` (``_untrack``)
        self._keep_partial: set[str] = set()  # requests the scheduler stopped to move: they send what they made
        self.link = Link(settings, self.worker_id, self)
        self.weights = Weights(self.worker_id, engine, self.link, self, settings.policy_version)

    async def run(self) -> None:
        """Serve until ``stop()``, over the link (which re-dials whenever the stream breaks);
        raises the engine's failure if the engine died."""
        await self.link.run()
        if self.failed is not None:
            raise self.failed

    async def stop(self) -> None:
        self.link.close()
        await self._drop_all()
        await self.weights.stop()

    def check_engine(self) -> None:
        """After a failed request: if the engine itself is dead, leave the scheduler (which
        re-queues this worker's work at once) and end ``run()`` with an error, so that the
        process exits and its supervisor (Kubernetes) starts a fresh one."""
        if self.failed is None and self.engine.dead:
            logger.error("worker %s: the inference engine died; leaving the scheduler", self.worker_id)
            self.failed = RuntimeError(f"worker {self.worker_id}: the inference engine died")
            self.link.close()

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
        now = time.monotonic()
        self.tokens_window = [(t, n) for t, n in self.tokens_window if now - t < 5.0]
        tps = sum(n for _, n in self.tokens_window) / 5.0
        return pb.Heartbeat(running=len(self.tasks), tokens_per_second=tps)

    async def alongside(self) -> None:
        await self._read_draft_cost()

    async def stream_ended(self) -> None:
        await self._drop_all()

    def requests_running(self) -> bool:
        """Whether any assignment (not a draft job) is still running on this worker."""
        return any(not key.startswith(DRAFT_PREFIX) for key in self.tasks)

    async def request_end(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a request's task to leave ``tasks``; whether one did."""
        self._request_ended.clear()
        try:
            await asyncio.wait_for(self._request_ended.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _untrack(self, key: str) -> asyncio.Task | None:
        """Take ``key``'s task out of ``tasks``; a request's end wakes a waiting completion batch."""
        task = self.tasks.pop(key, None)
        if task is not None and not key.startswith(DRAFT_PREFIX):
            self._request_ended.set()
        return task

    async def _read_draft_cost(self) -> None:
        """Every ``DRAFT_COST_SECONDS``, read what the engine's draft-length rule takes a draft
        token to cost (``VllmEngine.draft_cost``: set, or measured as it runs), for the metric
        ``bubblespec_worker_draft_token_seconds`` (and what a drafted request adds beyond its tokens,
        ``bubblespec_worker_drafted_request_seconds``). Off the heartbeat's loop: a busy engine
        answers late, and a late heartbeat gets a worker disconnected."""
        read = getattr(self.engine, "draft_cost", None)
        if read is None or not self.engine.info.speculation:
            return
        while True:
            try:
                cost = await read()
                self.draft_token_seconds, self.drafted_request_seconds = (
                    float(cost.get("draft_token_seconds", 0.0)), float(cost.get("drafted_request_seconds", 0.0)))
            except Exception as exc:  # telemetry: the gauge keeps its last value, the log says why
                logger.warning("worker %s: could not read the engine's draft token cost: %s", self.worker_id, exc)
            await asyncio.sleep(DRAFT_COST_SECONDS)

    # -------------------------------------------------------------- commands --

    async def handle(self, msg: pb.SchedulerMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "assign":
            a = msg.assign
            self.tasks[a.request_key] = asyncio.create_task(self._run_assignment(a))
        elif kind == "assigns":  # each as a single ``assign``; a bad one costs only itself
            for i, a in enumerate(msg.assigns.assignments):
                self.tasks[a.request_key] = asyncio.create_task(self._run_assignment(a, f"assigns[{i}]"))
        elif kind == "abort":
            if msg.abort.keep_partial and msg.abort.request_key in self.tasks:
                self._keep_partial.add(msg.abort.request_key)
            await self._cancel(msg.abort.request_key)
            self._keep_partial.discard(msg.abort.request_key)
        elif kind == "load_policy":
            await self.weights.load_policy(msg.load_policy)
        elif kind == "draft_job":
            job = msg.draft_job
            self.tasks[DRAFT_PREFIX + job.job_id] = asyncio.create_task(self._run_draft(job))
        elif kind == "stop_draft":
            self._stop_draft(DRAFT_PREFIX + msg.stop_draft.job_id)
        elif kind == "control":
            self.weights.control(msg.control)

    async def _cancel(self, key: str) -> None:
        task = self._untrack(key)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _stop_draft(self, key: str) -> None:
        """Cancel a draft job without waiting for its cleanup (the engine's abort, its partial
        draft stored, its ``draft_result``: a few milliseconds each). A step's start stops up
        to a worker's whole width of jobs; awaited one by one here, they held the step's
        assignments queued behind them on the stream for tens of milliseconds. No request can
        read the draft store too early: the scheduler holds a prompt's work until its stopped
        job's result came (``DraftJobs.stop_arrived``, scheduler/core/drafts.py)."""
        task = self.tasks.pop(key, None)
        if task is not None:
            task.cancel()
            self._stopped_jobs.add(task)
            task.add_done_callback(self._stopped_jobs.discard)

    # ------------------------------------------------ the weights' host (weights.Host) --

    def running(self) -> int:
        return len(self.tasks)

    async def drain(self) -> None:
        await self._drop_all()

    async def _drop_all(self) -> None:
        for key in list(self.tasks):
            await self._cancel(key)
        await asyncio.gather(*self._stopped_jobs, return_exceptions=True)  # stopped jobs too: none outlives this

    # ------------------------------------------------------------ generation --

    async def _drafts_for(self, prompt: tuple[int, ...], seed: int | None = None,
                          adapter: tuple[str, int] | None = None) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The stored drafts of ``prompt`` (under LoRA ``adapter`` (name, version): that version's
        alone); a request whose ``seed`` a draft job could have had gets none of the draft jobs'
        (``future``) ones (``shares_draft_seeds``)."""
        if self.store is None:
            return ()
        pk = prompt_key(prompt, adapter)
        entries = (await self.store.get_drafts([pk])).get(pk, [])
        if shares_draft_seeds(seed):
            entries = [e for e in entries if e.source is not DraftSource.FUTURE]
        entries = entries[: self.settings.max_drafts_per_request]
        return tuple((e.source.value, e.tokens) for e in entries if e.tokens)

    async def _run_assignment(self, a: pb.Assignment, where: str = "") -> None:
        """Run one assignment; a failure answers ``Aborted`` with the reason, after ``where``
        (the batch entry it came in as, ``assigns[3]``; "" for a single ``assign``)."""
        key = a.request_key
        before = cv.completion_from_pb(a.resume) if a.HasField("resume") else None  # moved here: go on from it
        last: Yielded | None = None  # the latest progress output, as yielded: what a stop sends
        loaded = self.weights.version  # the weights that generate it (stamped on the completion)
        prompt: tuple[int, ...] = ()
        try:
            prompt = tuple(a.prompt_token_ids[:])  # a slice first: one C loop, not one call per token
            sampling = cv.sampling_from_pb(a.sampling)
            adapter = (a.adapter, a.adapter_version) if a.adapter else None
            drafts = await self._drafts_for(prompt, sampling.seed, adapter) if a.use_drafts else ()
            request = EngineRequest(key, prompt, sampling, drafts, a.use_drafts, adapter=adapter,
                                    predicted_tokens=a.predicted_tokens, stream_tokens=ASSIGNMENT_STREAM_TOKENS)
            done_before = 0
            if before is not None:
                request, done_before = resumed(request, before), len(before.token_ids)
            last_report = time.monotonic()
            final = None
            seen = 0
            async for out in self.engine.generate(request):
                self.tokens_window.append((time.monotonic(), len(out.token_ids) - seen))
                seen = len(out.token_ids)
                if out.finish_reason is not None:
                    final = out
                else:
                    last = Yielded.of(out)
                    if time.monotonic() - last_report >= self.settings.progress_seconds:
                        last_report = time.monotonic()
                        self.link.report_progress(key, done_before + len(out.token_ids))
            if final is None or final.finish_reason is None:  # (a final output has its finish reason)
                raise RuntimeError("engine ended without a final output")
            if self.weights.version != loaded:
                raise RuntimeError(f"the weights changed from version {loaded} to {self.weights.version} during generation")
            ids, logprobs, text, provenance = joined(before, final)
            c = Completion(a.step_id, a.prompt_id, a.sample_index, ids, logprobs, text,
                           final.finish_reason, loaded, self.worker_id, len(prompt), provenance,
                           stop_reason=final.stop_reason, top_logprobs=joined_top_logprobs(before, final),
                           prompt_logprobs=joined_prompt_logprobs(before, final, len(prompt)),
                           adapter=a.adapter, adapter_version=a.adapter_version if a.adapter else 0)
            self.link.forget_progress(key)  # finished: its last progress report says nothing more
            for src in final.provenance.sources:
                tally = self.spec_tokens.setdefault(src.source, [0, 0])
                tally[0] += src.drafted_tokens
                tally[1] += src.accepted_tokens
            self.link.send(completion=pb.WorkerCompletion(request_key=key, completion=cv.completion_to_pb(c)))
            self._untrack(key)
            await self._remember(prompt, c, a.step_id, adapter)
        except asyncio.CancelledError:
            self.link.forget_progress(key)
            spent = await self.engine.abort(key)
            if key in self._keep_partial:  # stopped to move: send what it made, made by one policy version
                if self.weights.version == loaded:
                    sent = None if last is None else last.frozen()
                    made = partial(a.step_id, a.prompt_id, a.sample_index, before, sent, loaded, self.worker_id,
                                   len(prompt), spent)
                    self.link.send(aborted=pb.Aborted(request_key=key, reason="moved", partial=cv.completion_to_pb(made)))
                else:
                    self.link.send(aborted=pb.Aborted(request_key=key, reason=f"stopped to move, but the weights changed "
                                                  f"from version {loaded} to {self.weights.version} during generation"))
            raise
        except Exception as exc:
            logger.exception("request %s failed", key)
            self.link.forget_progress(key)
            self._untrack(key)
            self.link.send(aborted=pb.Aborted(request_key=key, reason=(f"{where}: {exc}" if where else str(exc))[:500]))
            self.check_engine()

    async def _remember(self, prompt: tuple[int, ...], c: Completion, step_id: str,
                        adapter: tuple[str, int] | None = None) -> None:
        if self.store is None or not self.settings.history_drafts:
            return
        pk = prompt_key(prompt, adapter)
        await self.store.put_draft(pk, DraftEntry(c.token_ids, c.policy_version, step_id, DraftSource.HISTORY, time.time()))
        await self.store.record_length(pk, len(c.token_ids))

    async def _run_draft(self, job: pb.DraftJob) -> None:
        key = DRAFT_PREFIX + job.job_id
        prompt = tuple(job.prompt_token_ids)
        tokens: Sequence[int] = ()
        finished = False
        started = time.monotonic()
        try:
            drafts = await self._drafts_for(prompt)
            request = EngineRequest(key, prompt, cv.sampling_from_pb(job.sampling), drafts, True, draft_job=True)
            async for out in self.engine.generate(request):
                tokens = out.token_ids  # live list until the final output
                finished = out.finish_reason is not None
                self.draft_tokens[job.job_id] = len(tokens)
        except asyncio.CancelledError:
            await self.engine.abort(key)
        except Exception:
            logger.exception("draft job %s failed", job.job_id)
            self.check_engine()
        finally:
            self.draft_seconds += time.monotonic() - started
            self.tasks.pop(key, None)
            self.draft_tokens.pop(job.job_id, None)
            await self._keep_draft(job, prompt, tuple(tokens), finished)

    async def _keep_draft(self, job: pb.DraftJob, prompt: tuple[int, ...], tokens: tuple[int, ...],
                          finished: bool) -> None:
        """Store a draft job's (partial) response, then report it (``draft_result``). The
        scheduler holds a new step's requests for the prompt until this report, so that none
        reads the store without the draft (``DraftJobs.stop_arrived``, scheduler/core/drafts.py). The report counts
        what was stored: a write the store refused (``put_draft`` False: Redis down, the breaker
        open, an oversized entry) or that raised reports no tokens (logged), so no prompt counts
        as drafted without one."""
        stored = 0
        if tokens and self.store is not None:
            entry = DraftEntry(tokens, job.policy_version, job.step_id, DraftSource.FUTURE, time.time())
            why = "the draft store did not take it"
            try:
                if await asyncio.shield(self.store.put_draft(prompt_key(prompt), entry)):
                    stored = len(tokens)
            except Exception as exc:  # noqa: BLE001 - a lost draft costs speed, never a result
                why = str(exc)
            if not stored:
                logger.warning("draft job %s: its %d tokens were not stored: %s", job.job_id, len(tokens), why)
        self.link.send(draft_result=pb.DraftResult(job_id=job.job_id, tokens=stored, finished=finished and stored > 0))


DRAFT_COST_SECONDS = 10.0
"""How often a worker reads its engine's draft token cost for its metrics."""


async def stop_agents(agents: list[WorkerAgent], tasks: list[asyncio.Task]) -> None:
    """Stop agents and wait for their ``run()`` tasks to end."""
    for agent in agents:
        await agent.stop()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

"""The worker's runner: the requests and draft jobs the scheduler hands a worker, run on its engine.

``Runner`` owns what runs: each assignment (``assign``; an ``assigns`` batch is one call per
entry) and each draft job (``start_draft``) is a task in ``tasks``, keyed by its request key
(a draft job's by ``DRAFT_PREFIX`` and its id). An assignment reads its prompt's stored drafts
(``drafts_for``), generates on the engine, reports progress (through the link, every
``progress_seconds``) and answers with its completion, which it also stores as a history draft
and a length; a failure answers ``Aborted`` with the reason. Moved here from another worker
it goes on from that worker's partial (``worker/resume.py``); stopped to move elsewhere
(``abort(keep_partial=True)``) it sends what it made. A draft job stores its (partial)
response as a ``future`` draft and reports what it stored (``draft_result``). Completions are
stamped with the policy version the weights had when they began (``Weights.version``); one
whose weights changed while it ran fails instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

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

__all__ = ["ASSIGNMENT_STREAM_TOKENS", "DRAFT_COST_SECONDS", "DRAFT_PREFIX", "Runner"]

logger = logging.getLogger(__name__)

ASSIGNMENT_STREAM_TOKENS = 16
"""An assignment's progress comes from the engine every 16 tokens (``EngineRequest.stream_tokens``):
its progress reports go out every ``progress_seconds`` anyway, and an aborted assignment keeps
nothing. Draft jobs stream every token: a preempted job keeps the tokens it has received."""
DRAFT_PREFIX = "draft:"
"""Prefix of a draft job's key in ``Runner.tasks`` (and the engine's request key); every
other key there is a request's."""
DRAFT_COST_SECONDS = 10.0
"""How often a worker reads its engine's draft token cost for its metrics."""
TOKENS_WINDOW_SECONDS = 5.0
"""The window of ``tokens_window``: the tokens/s a heartbeat reports is over the last 5 s."""


class Runner:
    """What runs on one worker's engine (module docstring). Owns ``tasks``, the draft store
    handle, and the figures the heartbeat and the worker's metrics read (``tokens_window``,
    ``draft_seconds``, ``spec_tokens``, the engine's draft-cost figures)."""

    def __init__(self, settings: WorkerSettings, worker_id: str, engine: Engine, store: DraftStore | None,
                 link: Link, weights: Weights, check_engine: Callable[[], None]):
        self.settings = settings
        self.worker_id = worker_id
        self.engine = engine
        self.store = store
        self.link = link
        self.weights = weights
        self.check_engine = check_engine  # after a failure: leave the scheduler if the engine died
        self.tasks: dict[str, asyncio.Task] = {}  # request key or draft job id -> task
        self.tokens_window: list[tuple[float, int]] = []
        self.draft_seconds = 0.0
        self.spec_tokens: dict[str, list[int]] = {}  # draft source -> [drafted, accepted], completed requests
        self.draft_token_seconds: float | None = None  # the engine's draft-length rule's figure (None: not read yet)
        self.drafted_request_seconds = 0.0  # its figure for a drafted request beyond its tokens (read with it)
        self.draft_tokens: dict[str, int] = {}  # running draft job id -> tokens generated so far
        self._stopped_jobs: set[asyncio.Task] = set()  # stopped draft jobs still cleaning up (``stop_draft``)
        self._request_ended = asyncio.Event()  # set when a request's task leaves ``tasks`` (``_untrack``)
        self._keep_partial: set[str] = set()  # requests the scheduler stopped to move: they send what they made

    # -------------------------------------------------------------- commands --

    def assign(self, a: pb.Assignment, where: str = "") -> None:
        """Start one assignment; ``where``: the batch entry it came in as (``assigns[3]``)."""
        self.tasks[a.request_key] = asyncio.create_task(self._run_assignment(a, where))

    async def abort(self, key: str, keep_partial: bool = False) -> None:
        """Stop a request; with ``keep_partial`` (stopped to move) it sends what it made."""
        if keep_partial and key in self.tasks:
            self._keep_partial.add(key)
        await self.cancel(key)
        self._keep_partial.discard(key)

    def start_draft(self, job: pb.DraftJob) -> None:
        self.tasks[DRAFT_PREFIX + job.job_id] = asyncio.create_task(self._run_draft(job))

    async def cancel(self, key: str) -> None:
        task = self._untrack(key)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def stop_draft(self, job_id: str) -> None:
        """Cancel a draft job without waiting for its cleanup (the engine's abort, its partial
        draft stored, its ``draft_result``: a few milliseconds each). A step's start stops up
        to a worker's whole width of jobs; awaited one by one here, they held the step's
        assignments queued behind them on the stream for tens of milliseconds. No request can
        read the draft store too early: the scheduler holds a prompt's work until its stopped
        job's result came (``DraftJobs.stop_arrived``, scheduler/core/drafts.py)."""
        task = self.tasks.pop(DRAFT_PREFIX + job_id, None)
        if task is not None:
            task.cancel()
            self._stopped_jobs.add(task)
            task.add_done_callback(self._stopped_jobs.discard)

    async def drop_all(self) -> None:
        """Cancel everything that runs, and wait for stopped draft jobs to finish cleaning up."""
        for key in list(self.tasks):
            await self.cancel(key)
        await asyncio.gather(*self._stopped_jobs, return_exceptions=True)  # stopped jobs too: none outlives this

    # ------------------------------------------------------ what the link reads --

    def heartbeat(self) -> pb.Heartbeat:
        """Tasks running and tokens/s over the last ``TOKENS_WINDOW_SECONDS``."""
        now = time.monotonic()
        self.tokens_window = [(t, n) for t, n in self.tokens_window if now - t < TOKENS_WINDOW_SECONDS]
        tps = sum(n for _, n in self.tokens_window) / TOKENS_WINDOW_SECONDS
        return pb.Heartbeat(running=len(self.tasks), tokens_per_second=tps)

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

    async def read_draft_cost(self) -> None:
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

    # ------------------------------------------------------------ generation --

    async def drafts_for(self, prompt: tuple[int, ...], seed: int | None = None,
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
            drafts = await self.drafts_for(prompt, sampling.seed, adapter) if a.use_drafts else ()
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
        await self.store.remember(prompt_key(prompt, adapter),
                                  DraftEntry(c.token_ids, c.policy_version, step_id, DraftSource.HISTORY, time.time()))

    async def _run_draft(self, job: pb.DraftJob) -> None:
        key = DRAFT_PREFIX + job.job_id
        prompt = tuple(job.prompt_token_ids)
        tokens: Sequence[int] = ()
        finished = False
        started = time.monotonic()
        try:
            drafts = await self.drafts_for(prompt)
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

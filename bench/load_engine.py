"""A simulated engine: emulates the cost and the tokens of generation without any model.

``LoadTestEngine`` implements the ``Engine`` protocol for load and scale tests of the control
plane (``bubblespec loadtest``). It loads no model and computes no logits: its tokens are
pseudo-random and its logprobs are made up. It is never a substitute for vLLM in a test that
claims real generation, and it says so: its model name is ``"simulated"``.

Cost model. Each engine step advances every running request by one token, the way a
continuous-batching engine does; a step lasts
``step_seconds + batch_slope_seconds * (running - 1)``, so a fuller batch decodes each request
more slowly. At most ``max_num_seqs`` requests run; later ones wait for a free slot. The engine
wakes only when something happens (a request's progress output or end, an arrival), not at
every step, so hundreds of simulated engines in one process cost little more than their
requests; an event loop that is late delays the event, not every step until it.

Tokens. Each request draws from its own generator, seeded by a hash of the prompt token ids
and, for temperature > 0, the request's sampling seed: greedy requests (temperature 0) are
reproducible on any engine, as are seeded ones. Unseeded requests draw from the engine's own
generator (seeded by ``seed``), as vLLM does. Token ids lie in ``[3, vocab_size)``; the EOS id
(2) ends a response at a length drawn from a log-normal distribution (median
``median_tokens``, shape ``length_sigma``): the long tail that makes stragglers. ``max_tokens``
(capped by the model length), ``stop_token_ids`` and ``ignore_eos`` behave as in vLLM; stop
strings need a detokenizer, which this engine has not, so they never match. No speculation:
``Provenance.forward_passes`` equals the number of tokens.

Prefix cache. With ``prefix_cache_tokens`` set, the engine keeps the block hashes of the
prompts and responses it ran, least recently used out first, and counts for each finished
request the prompt tokens those blocks held (``prefill``, as ``VllmEngine`` counts vLLM's
``num_cached_tokens``); timing ignores prefill either way.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import math
import random
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import ClassVar

from bubblespec.common.types import FinishReason, Provenance
from bubblespec.scheduler.core.affinity import prefix_hashes
from bubblespec.store.types import uint32_array
from bubblespec.worker.checkpoint import CheckpointError
from bubblespec.worker.engine import EngineInfo, EngineOutput, EngineRequest, PrefillCounts

__all__ = ["EOS_TOKEN_ID", "LoadEngineSettings", "LoadTestEngine"]

EOS_TOKEN_ID = 2
FIRST_TOKEN_ID = 3  # 0 pad, 1 bos, 2 eos are never drawn at random
MODEL_NAME = "simulated"


@dataclass(frozen=True)
class LoadEngineSettings:
    """Settings of one simulated engine (no model: cost and token statistics only)."""

    step_seconds: float = 0.02
    """Seconds of one engine step (one token for every running request) with one request running."""
    batch_slope_seconds: float = 0.0005
    """Extra seconds per engine step for each further running request (batch cost)."""
    vocab_size: int = 32000
    """Vocabulary size reported to the scheduler; tokens are drawn from [3, vocab_size)."""
    max_model_len: int = 1024
    """Longest prompt + response in tokens."""
    max_num_seqs: int = 64
    """Requests running at once; further requests wait for a slot."""
    median_tokens: int = 64
    """Median response length when EOS is honoured (log-normal distribution)."""
    length_sigma: float = 0.8
    """Shape of the log-normal length distribution (larger: longer tail)."""
    progress_tokens: int = 16
    """Tokens between two progress outputs of ``generate`` (vLLM yields every step; fewer
    wake-ups keep hundreds of simulated engines in one process cheap)."""
    load_seconds: float = 0.05
    """Seconds ``load_weights`` takes (nothing is read)."""
    seed: int = 0
    """Seed of the generator that unseeded requests draw from."""
    prefix_cache_tokens: int = 0
    """Tokens the simulated prefix cache holds (in blocks of ``PREFIX_BLOCK``); 0: no cache."""
    self_checks: ClassVar[bool] = False
    """The worker self-checks (``worker/selfcheck.py``) test vLLM; a simulated engine has none."""

    def validate(self) -> LoadEngineSettings:
        """Return self if every field is usable, else raise ValueError naming the field."""
        for name in ("step_seconds", "batch_slope_seconds", "load_seconds"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.vocab_size <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {self.vocab_size}")
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}")
        for name in ("max_model_len", "max_num_seqs", "median_tokens", "progress_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not math.isfinite(self.length_sigma) or self.length_sigma < 0:
            raise ValueError(f"length_sigma must be a finite number >= 0, got {self.length_sigma!r}")
        return self


PREFIX_BLOCK = 16
"""Tokens per block of the simulated prefix cache (vLLM's default KV block)."""


class _PrefixCache:
    """Block hashes of recent prompts and responses, least recently used evicted first."""

    def __init__(self, tokens: int):
        self.capacity = tokens // PREFIX_BLOCK
        self._blocks: dict[int, None] = {}  # insertion order = recency

    def cached(self, prompt: tuple[int, ...]) -> int:
        """Prompt tokens held, from the first block up to the first missing one."""
        held = 0
        for h in prefix_hashes(prompt, PREFIX_BLOCK):
            if h not in self._blocks:
                break
            held += PREFIX_BLOCK
        return held

    def keep(self, tokens: tuple[int, ...]) -> None:
        for h in prefix_hashes(tokens, PREFIX_BLOCK):
            self._blocks.pop(h, None)
            self._blocks[h] = None
        while len(self._blocks) > self.capacity:
            del self._blocks[next(iter(self._blocks))]


@dataclass(eq=False)
class _Run:
    """One request inside the engine. Its whole response is drawn when it is queued (``_draw``:
    the same tokens, one at a time from its own generator, as drawing each at its step); the
    engine's steps only reveal it, ``shown`` growing at each progress output."""

    key: str
    tokens: tuple[int, ...]  # the whole response
    logprobs: tuple[float, ...]
    reason: FinishReason  # how it ends
    shown: list[int] = field(default_factory=list)  # the tokens revealed so far (a live list)
    start: int = -1  # the engine step after which it was admitted (-1: waiting)
    done: bool = False  # every token revealed: the final output is ready
    aborted: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class LoadTestEngine:
    """An ``Engine`` that emulates generation: timing from a cost model, pseudo-random tokens."""

    def __init__(self, settings: LoadEngineSettings = LoadEngineSettings()):
        self.settings = settings.validate()
        self.info = EngineInfo(MODEL_NAME, settings.max_model_len, settings.vocab_size, False)
        self.weights_path = ""
        """Path of the last ``load_weights`` call (recorded, never read)."""
        self.loads = 0
        self.dead = False
        """Failed for good (``kill``)."""
        self.engine_steps = 0
        """Engine steps run so far (one token for every running request each)."""
        self._rng = random.Random(settings.seed)
        self._running: dict[str, _Run] = {}
        self._waiting: deque[_Run] = deque()
        self._events: list[tuple[int, int, _Run]] = []  # (engine step of a run's next output, order, run), a heap
        self._order = 0
        self._timer: asyncio.TimerHandle | None = None  # ends the steps up to ``_timer_step``
        self._timer_step = 0
        self._step_at = 0.0  # loop time at which step ``engine_steps`` ended
        self._started = False
        self.prefill = PrefillCounts()
        self._cache = _PrefixCache(settings.prefix_cache_tokens) if settings.prefix_cache_tokens else None

    @property
    def num_running(self) -> int:
        return len(self._running)

    def kill(self) -> None:
        """Fail for good, as a crashed vLLM engine does: every request errors, now and later."""
        self.dead = True
        for run in [*self._running.values(), *self._waiting]:
            run.wake.set()

    async def start(self) -> None:
        self._started = True

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Yield progress (``token_ids`` is a live list, valid until the next yield), then the
        final output (tuples, ``finish_reason`` set). An aborted request ends without one."""
        if not self._started:
            raise RuntimeError("engine not started")
        if self.dead:
            raise RuntimeError("engine died")
        run = self._new_run(request)
        prompt = request.prompt_token_ids
        held = 0
        if self._cache is not None:  # prefill: what the cache holds now, then the prompt is in it
            held = self._cache.cached(prompt)
            self._cache.keep(prompt)
        self._waiting.append(run)
        self._arrived()
        try:
            while True:
                await run.wake.wait()
                run.wake.clear()
                if self.dead:
                    raise RuntimeError("engine died")
                if run.aborted:
                    return
                if run.done:
                    break
                yield EngineOutput(run.key, run.shown)  # type: ignore[arg-type]
            if not request.draft_job:
                self.prefill.add(len(prompt), held)
            if self._cache is not None:
                self._cache.keep((*prompt, *run.tokens))
            yield EngineOutput(run.key, run.tokens, run.logprobs, "", run.reason,
                               Provenance(forward_passes=len(run.tokens)))
        finally:
            self._drop(run)

    async def abort(self, key: str) -> None:
        run = self._running.get(key) or next((r for r in self._waiting if r.key == key), None)
        if run is not None:
            run.aborted = True
            run.wake.set()
            self._drop(run)

    async def load_weights(self, path: str) -> None:
        if not path:
            raise CheckpointError("weights_path is empty")  # refused: nothing changed
        await asyncio.sleep(self.settings.load_seconds)
        self.weights_path = path
        self.loads += 1

    async def control(self, op: str, args: dict) -> dict:
        """A simulated engine has no KV cache to reset and no weights to receive."""
        if op == "reset_prefix_cache":
            return {"success": True}
        raise RuntimeError(f"{op}: the simulated engine has no weight transfer")

    async def shutdown(self) -> None:
        self._started = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for run in [*self._running.values(), *self._waiting]:
            run.aborted = True
            run.wake.set()
        self._running.clear()
        self._waiting.clear()
        self._events.clear()

    # ------------------------------------------------------------- internals --

    def _new_run(self, request: EngineRequest) -> _Run:
        s = self.settings
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        if len(prompt) >= s.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; the model length is {s.max_model_len}")
        if request.key in self._running or any(r.key == request.key for r in self._waiting):
            raise ValueError(f"request {request.key!r} is already running")
        sp = request.sampling
        greedy = sp.temperature == 0
        if greedy or sp.seed is not None:
            rng = random.Random(_digest(prompt, None if greedy else sp.seed))
        else:
            rng = random.Random(self._rng.getrandbits(64))
        length = max(1, round(rng.lognormvariate(math.log(s.median_tokens), s.length_sigma)))
        limit = max(1, min(sp.max_tokens, s.max_model_len - len(prompt)))
        return _Run(request.key, *self._draw(rng, limit, None if sp.ignore_eos else length, frozenset(sp.stop_token_ids)))

    def _draw(self, rng: random.Random, limit: int, eos_at: int | None,
              stop_ids: frozenset[int]) -> tuple[tuple[int, ...], tuple[float, ...], FinishReason]:
        """A whole response, token by token from ``rng`` (each a token id, then its logprob):
        EOS at ``eos_at`` tokens (None: never), a stop id or ``limit`` tokens end it."""
        tokens: list[int] = []
        logprobs: list[float] = []
        # rng.randrange(FIRST_TOKEN_ID, vocab_size) and -rng.expovariate(2.0), inlined: the same
        # draws (CPython's rejection sampling with getrandbits; -log(1 - random()) / lambda)
        width = self.settings.vocab_size - FIRST_TOKEN_ID
        bits = width.bit_length()
        getrandbits, uniform, log = rng.getrandbits, rng.random, math.log
        while True:
            n = len(tokens) + 1
            if eos_at is not None and n >= eos_at:
                token = EOS_TOKEN_ID
            else:
                r = getrandbits(bits)
                while r >= width:
                    r = getrandbits(bits)
                token = FIRST_TOKEN_ID + r
            tokens.append(token)
            logprobs.append(-(-log(1.0 - uniform()) / 2.0))
            if token == EOS_TOKEN_ID or token in stop_ids:
                return tuple(tokens), tuple(logprobs), FinishReason.STOP
            if n >= limit:
                return tuple(tokens), tuple(logprobs), FinishReason.LENGTH

    # The steps. Every running request gains one token per step, and nothing but a request's
    # progress output, its end or an arrival changes what the engine does; so the engine sleeps
    # from one such event to the next (one timer, not one per step) and reveals the tokens of
    # the steps in between at once. A step lasts ``step_seconds + batch_slope_seconds *
    # (running - 1)`` for the running count between two events; a request that arrives while
    # a slot is free joins at the end of the step in progress, as it would in a step loop.

    def _step_seconds(self) -> float:
        s = self.settings
        return s.step_seconds + s.batch_slope_seconds * (len(self._running) - 1)

    def _arrived(self) -> None:
        """A request was queued: an idle engine starts stepping now; a busy one with a free
        slot ends its timer at the end of the step in progress, where the request joins."""
        if len(self._running) >= self.settings.max_num_seqs:
            return  # it joins when a request ends (an event)
        loop = asyncio.get_running_loop()
        if not self._running:  # idle: start stepping as soon as the loop comes round, with whatever arrived by then
            if self._timer is None or self._timer_step != self.engine_steps:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer_step = self.engine_steps
                self._timer = loop.call_at(loop.time(), self._steps_done)
            return
        seconds = self._step_seconds()
        ahead = 1 if seconds <= 0 else int((loop.time() - self._step_at) / seconds) + 1  # the step in progress
        if self._timer is None or self.engine_steps + ahead < self._timer_step:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_step = self.engine_steps + ahead
            self._timer = loop.call_at(self._step_at + ahead * seconds, self._steps_done)

    def _steps_done(self) -> None:
        """The timer: the steps up to ``_timer_step`` have run (they end now)."""
        loop = asyncio.get_running_loop()
        self._timer = None
        self._step_at = loop.time()
        self.engine_steps = self._timer_step
        self._reveal()
        self._admit()
        self._schedule(loop)

    def _reveal(self) -> None:
        """The outputs due by now: a finished request's end, another's progress."""
        step, events = self.engine_steps, self._events
        while events and events[0][0] <= step:
            run = heapq.heappop(events)[2]
            if self._running.get(run.key) is not run:
                continue  # aborted or dropped meanwhile
            made = step - run.start
            if made >= len(run.tokens):
                run.done = True
                del self._running[run.key]
            else:
                run.shown.extend(run.tokens[len(run.shown):made])
                self._next_event(run)
            run.wake.set()

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.settings.max_num_seqs:
            run = self._waiting.popleft()
            run.start = self.engine_steps
            self._running[run.key] = run
            self._next_event(run)

    def _next_event(self, run: _Run) -> None:
        """Queue ``run``'s next output: its end, or ``progress_tokens`` more tokens."""
        made = min(len(run.tokens), len(run.shown) + self.settings.progress_tokens)
        self._order += 1
        heapq.heappush(self._events, (run.start + made, self._order, run))

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """Set the timer for the next event of a running request (none: the engine idles)."""
        events = self._events
        while events and self._running.get(events[0][2].key) is not events[0][2]:
            heapq.heappop(events)
        if not events:
            return
        self._timer_step = events[0][0]
        self._timer = loop.call_at(self._step_at + (self._timer_step - self.engine_steps) * self._step_seconds(),
                                   self._steps_done)

    def _drop(self, run: _Run) -> None:
        if self._running.get(run.key) is run:
            del self._running[run.key]
        elif run in self._waiting:
            self._waiting.remove(run)


def _digest(prompt: tuple[int, ...], seed: int | None) -> int:
    """A stable 64-bit seed from the prompt and the sampling seed (same on every machine)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(len(prompt).to_bytes(4, "little"))
    h.update(uint32_array(prompt).tobytes())  # the same bytes as each id's 4-byte little-endian form, in C
    h.update(b"greedy" if seed is None else seed.to_bytes(8, "little", signed=False))
    return int.from_bytes(h.digest(), "little")

"""A simulated engine: emulates the cost and the tokens of generation without any model.

``LoadTestEngine`` implements the ``Engine`` protocol for load and scale tests of the control
plane (``bubblespec loadtest``). It loads no model and computes no logits: its tokens are
pseudo-random and its logprobs are made up. It is never a substitute for vLLM in a test that
claims real generation, and it says so: its model name is ``"simulated"``.

Cost model. One engine-step loop per engine advances every running request by one token per
step, the way a continuous-batching engine does; a step lasts
``step_seconds + batch_slope_seconds * (running - 1)``, so a fuller batch decodes each request
more slowly. At most ``max_num_seqs`` requests run; later ones wait for a free slot.

Tokens. Each request draws from its own generator, seeded by a hash of the prompt token ids
and, for temperature > 0, the request's sampling seed: greedy requests (temperature 0) are
reproducible on any engine, as are seeded ones. Unseeded requests draw from the engine's own
generator (seeded by ``seed``), as vLLM does. Token ids lie in ``[3, vocab_size)``; the EOS id
(2) ends a response at a length drawn from a log-normal distribution (median
``median_tokens``, shape ``length_sigma``): the long tail that makes stragglers. ``max_tokens``
(capped by the model length), ``stop_token_ids`` and ``ignore_eos`` behave as in vLLM; stop
strings need a detokenizer, which this engine has not, so they never match. No speculation:
``Provenance.forward_passes`` equals the number of tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from bubblespec.client.types import FinishReason, Provenance
from bubblespec.store.types import uint32_array
from bubblespec.worker.checkpoint import CheckpointError
from bubblespec.worker.engine import EngineInfo, EngineOutput, EngineRequest

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

    def validate(self) -> LoadEngineSettings:
        """Return self if every field is usable, else raise ValueError naming the field."""
        for name in ("step_seconds", "batch_slope_seconds", "load_seconds"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.vocab_size <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {self.vocab_size}")
        for name in ("max_model_len", "max_num_seqs", "median_tokens", "progress_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not math.isfinite(self.length_sigma) or self.length_sigma < 0:
            raise ValueError(f"length_sigma must be a finite number >= 0, got {self.length_sigma!r}")
        return self


@dataclass(eq=False)
class _Run:
    """One request inside the engine."""

    key: str
    rng: random.Random
    limit: int  # most tokens it may produce (max_tokens capped by the model length)
    eos_at: int | None  # response length at which EOS comes (None: ignore_eos)
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: FinishReason | None = None
    aborted: bool = False
    reported: int = 0
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
        self._work = asyncio.Event()
        self._loop: asyncio.Task | None = None

    @property
    def num_running(self) -> int:
        return len(self._running)

    def kill(self) -> None:
        """Fail for good, as a crashed vLLM engine does: every request errors, now and later."""
        self.dead = True
        for run in [*self._running.values(), *self._waiting]:
            run.wake.set()

    async def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.create_task(self._step_loop(), name="simulated-engine-steps")

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Yield progress (``token_ids`` is a live list, valid until the next yield), then the
        final output (tuples, ``finish_reason`` set). An aborted request ends without one."""
        if self._loop is None:
            raise RuntimeError("engine not started")
        if self.dead:
            raise RuntimeError("engine died")
        run = self._new_run(request)
        self._waiting.append(run)
        self._work.set()
        try:
            while True:
                await run.wake.wait()
                run.wake.clear()
                if self.dead:
                    raise RuntimeError("engine died")
                if run.aborted:
                    return
                if run.reason is not None:
                    break
                run.reported = len(run.tokens)
                yield EngineOutput(run.key, run.tokens)  # type: ignore[arg-type]
            tokens = tuple(run.tokens)
            yield EngineOutput(run.key, tokens, tuple(run.logprobs), "", run.reason,
                               Provenance(forward_passes=len(tokens)))
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
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
            self._loop = None
        for run in [*self._running.values(), *self._waiting]:
            run.aborted = True
            run.wake.set()
        self._running.clear()
        self._waiting.clear()

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
        return _Run(request.key, rng, limit, None if sp.ignore_eos else length, frozenset(sp.stop_token_ids))

    async def _step_loop(self) -> None:
        s = self.settings
        while True:
            self._admit()
            if not self._running:
                self._work.clear()
                await self._work.wait()
                continue
            await asyncio.sleep(s.step_seconds + s.batch_slope_seconds * (len(self._running) - 1))
            self.engine_steps += 1
            for run in list(self._running.values()):
                self._advance(run)
                if run.reason is not None:
                    del self._running[run.key]
                    run.wake.set()
                elif len(run.tokens) - run.reported >= s.progress_tokens:
                    run.wake.set()

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.settings.max_num_seqs:
            run = self._waiting.popleft()
            self._running[run.key] = run

    def _advance(self, run: _Run) -> None:
        """One decode step of one request: one token, its logprob, maybe the end."""
        n = len(run.tokens) + 1
        if run.eos_at is not None and n >= run.eos_at:
            token = EOS_TOKEN_ID
        else:
            token = run.rng.randrange(FIRST_TOKEN_ID, self.settings.vocab_size)
        run.tokens.append(token)
        run.logprobs.append(-run.rng.expovariate(2.0))
        if token == EOS_TOKEN_ID or token in run.stop_ids:
            run.reason = FinishReason.STOP
        elif n >= run.limit:
            run.reason = FinishReason.LENGTH

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

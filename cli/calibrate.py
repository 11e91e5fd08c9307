"""``bubblespec calibrate``: measure one engine's cost per forward pass, for the simulator.

The simulator's cost model (``bubblespec.bench.sim.costs``) charges a forward pass

    base + per_seq * batch + per_draft_token * draft tokens + prefill_per_token * prompt tokens

This command measures those four constants on a real engine. It times batches of ``B``
requests that each decode exactly ``L`` tokens (``ignore_eos``, greedy), for several ``B``:

* without drafts: every pass decodes one token per request;
* with perfect drafts (each request's own response, computed first), so every draft token is
  accepted and each pass verifies about ``num_speculative_tokens`` of them per request;
* one long prompt against one short prompt, with a single output token, for prefill.

Seconds per pass (wall time over forward passes, so everything a pass costs the service is
in it) are fitted by least squares (see ``fit``); a negative constant is clipped to 0. The
result prints as a ``CostProfile`` to paste into ``bubblespec.bench.sim.costs``, and
``per_draft_token_seconds`` as the worker flag ``--draft-token-seconds`` that turns on the
paying draft-length rule (``EngineSettings.draft_token_seconds``). The engine measured here
runs with that rule off whatever the flags say, so every pass verifies the full draft.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

__all__ = ["CalibrationConfig", "calibrate", "fit"]


@dataclass(frozen=True)
class CalibrationConfig:
    batches: tuple[int, ...] = (1, 4, 16, 48)
    """Batch sizes measured."""
    decode_tokens: int = 96
    """Tokens each request decodes (L)."""
    prompt_tokens: int = 16
    """Prompt length of the decode runs."""
    long_prompt_tokens: int = 512
    """Prompt length of the prefill run."""
    repeats: int = 3
    """Runs per point; the median is fitted."""
    seed: int = 0


@dataclass(frozen=True)
class Observation:
    batch: int
    draft_tokens_per_pass: float
    prefill_tokens_per_pass: float
    seconds_per_pass: float
    kind: str = "decode"
    """``decode`` (a run of many passes) or ``prefill`` (one pass: prompt in, one token out)."""


def fit(obs: list[Observation]) -> dict[str, float]:
    """Fit the linear cost model; constants clipped at 0.

    Prefill comes from the two ``prefill`` observations (a long and a short prompt): the
    difference in time over the difference in prompt tokens, so the per-request overhead
    both share cancels. The other three constants come from a least-squares fit of the
    ``decode`` observations, less their (amortised) prefill."""
    import numpy as np

    pre = sorted((o for o in obs if o.kind == "prefill"), key=lambda o: o.prefill_tokens_per_pass)
    prefill = 0.0
    if len(pre) >= 2 and pre[-1].prefill_tokens_per_pass > pre[0].prefill_tokens_per_pass:
        prefill = max(0.0, (pre[-1].seconds_per_pass - pre[0].seconds_per_pass)
                      / (pre[-1].prefill_tokens_per_pass - pre[0].prefill_tokens_per_pass))
    dec = [o for o in obs if o.kind == "decode"]
    a = np.array([[1.0, o.batch, o.draft_tokens_per_pass] for o in dec])
    y = np.array([o.seconds_per_pass - prefill * o.prefill_tokens_per_pass for o in dec])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    names = ("base_seconds", "per_seq_seconds", "per_draft_token_seconds")
    return {**{n: max(0.0, float(c)) for n, c in zip(names, coef)}, "prefill_per_token_seconds": prefill}


async def _timed(engine, prompts, max_tokens: int, drafts=None, tag: str = "c") -> tuple[float, list]:
    from bubblespec.common.types import SamplingParams
    from bubblespec.worker.engine import EngineRequest

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int, p: tuple[int, ...]):
        d = (("future", drafts[i]),) if drafts else ()
        final = None
        async for out in engine.generate(EngineRequest(f"{tag}-{time.time_ns()}-{i}", p, sp, d, bool(drafts))):
            final = out
        return final

    started = time.perf_counter()
    outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - started, list(outs)


async def calibrate(engine, cfg: CalibrationConfig = CalibrationConfig(), log=print) -> dict:
    """Measure ``engine`` (started, speculation on); return observations and the fitted profile."""
    rng = random.Random(cfg.seed)
    vocab = engine.info.vocab_size
    prompt = lambda n: tuple(rng.randrange(4, vocab) for _ in range(n))  # noqa: E731
    await _timed(engine, [prompt(cfg.prompt_tokens) for _ in range(4)], 16, tag="warm")
    obs: list[Observation] = []
    for b in cfg.batches:
        prompts = [prompt(cfg.prompt_tokens) for _ in range(b)]
        for mode in ("plain", "drafted"):
            runs = []
            drafts = None
            for r in range(cfg.repeats):
                if mode == "drafted" and drafts is None:
                    _, outs = await _timed(engine, prompts, cfg.decode_tokens, tag="ref")
                    drafts = [o.token_ids for o in outs]
                seconds, outs = await _timed(engine, prompts, cfg.decode_tokens, drafts, tag=f"{mode}{b}-{r}")
                passes = max(o.provenance.forward_passes for o in outs)
                drafted = sum(o.provenance.drafted() for o in outs)
                runs.append((seconds / passes, drafted / passes, b * cfg.prompt_tokens / passes))
            per_pass, per_draft, prefill = (statistics.median(x[i] for x in runs) for i in range(3))
            obs.append(Observation(b, per_draft, prefill, per_pass))
            log(f"  batch {b:3d} {mode:>7}: {1e3 * per_pass:6.2f} ms/pass, {per_draft:6.1f} draft tokens/pass")
    for n in (cfg.prompt_tokens, cfg.long_prompt_tokens):
        runs = [(await _timed(engine, [prompt(n)], 1, tag=f"prefill{n}"))[0] for _ in range(cfg.repeats)]
        obs.append(Observation(1, 0.0, float(n), statistics.median(runs), kind="prefill"))
        log(f"  prompt {n:4d} tokens: {1e3 * statistics.median(runs):6.2f} ms for prefill + 1 token")
    return {"config": asdict(cfg), "observations": [asdict(o) for o in obs], "profile": fit(obs)}


def main(args) -> None:
    from dataclasses import replace
    from pathlib import Path

    from bubblespec.cli.commands import _engine_settings, _preload_vllm, ensure_tiny_model
    from bubblespec.worker.engine import VllmEngine

    args.model = args.model or ensure_tiny_model()
    # full drafts: a cost rule, set or measured, would shorten them
    settings = replace(_engine_settings(args), draft_token_seconds=0.0, measure_draft_cost=False)
    _preload_vllm()  # before the loop starts: VllmEngine.start would import it on the loop

    async def go() -> dict:
        engine = VllmEngine(settings)
        await engine.start()
        try:
            return await calibrate(engine, CalibrationConfig(repeats=args.repeats))
        finally:
            await engine.shutdown()

    report = asyncio.run(go())
    p = report["profile"]
    print("\nCostProfile(")
    for name, value in p.items():
        print(f"    {name}={value:.3e},")
    print(")")
    print(f"worker: --draft-token-seconds {p['per_draft_token_seconds']:.3e}  (draft length by cost)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")

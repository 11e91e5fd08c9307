"""Exactness over many repetitions: are the chi-square p-values of every draft source uniform?

One chi-square test at p > 0.01 on fresh samples fails about one run in a hundred by chance
(``check_sampling_keeps_distribution`` therefore samples on fixed seeds), and passes a small
bias often. This script repeats the comparison ``--reps``
times with fresh samples and tests the p-values for uniformity (Kolmogorov-Smirnov against
U(0, 1)): under exact speculation they are uniform whatever the draft source; a bias, however
small, piles them up near 0.

Each repetition samples PROMPT ``--samples`` times at temperature 1, 3 tokens each, on an engine
without speculation (the reference), then on the BubbleSpec engine once per draft source (all
repetitions' requests are sent as one batch per arm, then split), and takes the chi-square
p-value of the 2nd and of the 3rd token (the drafted, verified ones; binned,
``binned_pvalue``) against that repetition's reference sample:

* ``future``: for every first token t, the greedy continuation after t;
* ``history``: for every first token t, random tokens;
* ``sibling``: 64 distinct reference responses, a group's finished samples (the grouped drafts'
  source: many drafts per first token, from the policy's own distribution);
* ``suffix``: no candidates; the engine drafts from the request's own text (self-suffix
  drafting), on a prompt built so that it finds a draft after any first token.

``--control`` adds an engine without the CPU rejection-sampler fix (a known bias) with the
``future`` drafts, to show the test sees a bias of that size. Prints a table and writes
``--out`` (JSON) with every p-value.

Usage (about 1-2 s per source per repetition of 1,000 samples on a quiet 2-core machine, plus
35-60 s per engine start)::

    .venv/bin/python -m tests.support.exactness_ks --reps 100 --samples 1000 --control --out ks.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scipy.stats import chi2_contingency, kstest

from bubblespec.bench.tiny_model import build_tiny_model
from bubblespec.client import SamplingParams
from bubblespec.worker.engine import EngineRequest, EngineSettings, VllmEngine
from tests.support.exactness import PROMPT, adversarial_candidates, check_provenance

SAMPLING = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
VOCAB = 128
_rng = random.Random(5)
REPEATING = tuple(t for first in range(VOCAB) for t in (3, 4, first, _rng.randrange(VOCAB), _rng.randrange(VOCAB))) + (3, 4)
"""The ``suffix`` source's prompt: for every first token t, the 3-token suffix (3, 4, t) occurs
in it followed by two tokens, so self-suffix drafting (3-token matches) drafts whatever token
is sampled first."""
SOURCES = ("future", "history", "sibling", "suffix")
BINS = 4
KS_FLOOR = 0.01


def binned_pvalue(a: list[int], b: list[int], bins: int = BINS) -> float:
    """Chi-square homogeneity p-value of two samples of token ids, binned by id mod ``bins``.

    Binned so that every cell expects tens of counts at a few hundred samples: the test's
    p-values are then close to uniform under the null, as the KS test over them requires (with
    a hundred sparse categories they pile up at 1)."""
    table = [[sum(1 for t in s if t % bins == k) for k in range(bins)] for s in (a, b)]
    table = [list(col) for col in zip(*[c for c in zip(*table) if sum(c) > 0])]
    return float(chi2_contingency(table)[1])


def token_pvalues(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> list[float]:
    """Binned p-values of the 2nd and 3rd tokens (the drafted, verified ones)."""
    return [binned_pvalue([s[k] for s in a], [s[k] for s in b]) for k in (1, 2)]


@dataclass
class SourceResult:
    """One draft source's p-values over the repetitions (2nd and 3rd token) and its KS test."""

    name: str
    p_token2: list[float] = field(default_factory=list)
    p_token3: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    def ks(self) -> tuple[float, float]:
        """KS p-values of the 2nd and 3rd tokens' chi-square p-values against U(0, 1)."""
        return float(kstest(self.p_token2, "uniform").pvalue), float(kstest(self.p_token3, "uniform").pvalue)


def uniform_enough(result: SourceResult, floor: float = KS_FLOOR) -> bool:
    """Both tokens' p-values pass the KS test at ``floor`` (and there are at least 20 of each)."""
    if min(len(result.p_token2), len(result.p_token3)) < 20:
        raise ValueError(f"{result.name}: {len(result.p_token2)} repetitions are too few for a KS test")
    return min(result.ks()) >= floor


async def _sample(engine: VllmEngine, prompt: tuple[int, ...], n: int, candidates: list | None,
                  use_drafts: bool) -> tuple[list[tuple[int, ...]], int, int]:
    """``n`` responses of ``prompt``; request i verifies ``candidates[i % len]``; (tokens, drafted, accepted)."""
    sem = asyncio.Semaphore(512)

    async def one(i: int):
        drafts = tuple(candidates[i % len(candidates)]) if candidates else ()
        req = EngineRequest(f"ks{i}-{random.getrandbits(40):x}", prompt, SAMPLING, drafts, use_drafts)
        async with sem:
            final = None
            async for out in engine.generate(req):
                final = out
        return final

    outs = await asyncio.gather(*(one(i) for i in range(n)))
    drafted, accepted = check_provenance(outs, use_drafts, "ks")
    return [tuple(o.token_ids) for o in outs], drafted, accepted


def _group(responses: list[tuple[int, ...]], size: int = 64) -> list[tuple[int, ...]]:
    """Up to ``size`` distinct responses: a group's finished samples."""
    distinct = sorted(set(responses))
    return random.sample(distinct, min(size, len(distinct)))


def _settings(model: str, **over) -> EngineSettings:
    base = dict(model=model, max_model_len=1024, max_num_seqs=64, num_speculative_tokens=4,
                kv_cache_memory_bytes=128 * 2**20, measure_draft_cost=False)
    base.update(over)
    return EngineSettings(**base)


async def run(reps: int, samples: int, control: bool, seed: int,
              sources: list[str] | tuple[str, ...] = ()) -> dict[str, SourceResult]:
    """Every source of ``sources`` (all where empty), and the control with ``control``."""
    random.seed(seed)
    model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="ks-model-")) / "tiny"))
    reference = VllmEngine(_settings(model, num_speculative_tokens=0))
    engine = VllmEngine(_settings(model, self_suffix_drafting=True))
    unfixed = VllmEngine(_settings(model, cpu_sampler_fix=False)) if control else None
    engines = [e for e in (reference, engine, unfixed) if e is not None]
    for e in engines:
        await e.start()
    try:
        greedy, garbage = await adversarial_candidates(reference)
        siblings, _, _ = await _sample(reference, PROMPT, samples, None, False)
        arms = {
            "future": (engine, PROMPT, [greedy]),
            "history": (engine, PROMPT, [garbage]),
            "sibling": (engine, PROMPT, [[("sibling", s) for s in _group(siblings)]]),
            "suffix": (engine, REPEATING, None),
        }
        arms = {name: arm for name, arm in arms.items() if not sources or name in sources}
        if unfixed is not None:
            arms["control: future, no sampler fix"] = (unfixed, PROMPT, [greedy])
        # every repetition's samples drawn in one batch per arm (independent requests, so the
        # same as drawing them repetition by repetition), then split into repetitions
        t0 = time.monotonic()
        total = reps * samples
        off = {prompt: (await _sample(reference, prompt, total, None, False))[0] for prompt in (PROMPT, REPEATING)}
        print(f"reference: {2 * total} responses in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        results = {}
        for name, (eng, prompt, cands) in arms.items():
            got, drafted, accepted = await _sample(eng, prompt, total, cands, True)
            r = results[name] = SourceResult(name, drafted=drafted, accepted=accepted)
            for rep in range(reps):
                part = slice(rep * samples, (rep + 1) * samples)
                p2, p3 = token_pvalues(off[prompt][part], got[part])
                r.p_token2.append(p2)
                r.p_token3.append(p3)
            print(f"{name}: {total} responses, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        return results
    finally:
        for e in engines:
            await e.shutdown()


def report(results: dict[str, SourceResult]) -> str:
    lines = ["| draft source | repetitions | drafted | accepted | KS p, 2nd token | KS p, 3rd token | "
             "chi-square p < 0.01 | uniform (KS p >= 0.01) |", "|---|---|---|---|---|---|---|---|"]
    for r in results.values():
        k2, k3 = r.ks()
        low = sum(p < 0.01 for p in r.p_token2 + r.p_token3)
        lines.append(f"| {r.name} | {len(r.p_token2)} | {r.drafted} | {r.accepted} | {k2:.3g} | {k3:.3g} | "
                     f"{low} of {2 * len(r.p_token2)} | {'yes' if uniform_enough(r) else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=100, help="repetitions (at least 20)")
    p.add_argument("--samples", type=int, default=1000, help="responses per arm and repetition")
    p.add_argument("--control", action="store_true", help="add the engine without the CPU sampler fix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write every p-value here (JSON)")
    p.add_argument("--sources", default=",".join(SOURCES),
                   help=f"the draft sources to test, comma-separated (of {', '.join(SOURCES)})")
    args = p.parse_args(argv)
    sources = [s for s in args.sources.split(",") if s]
    unknown = [s for s in sources if s not in SOURCES]
    if unknown or not sources:
        p.error(f"--sources: {', '.join(unknown) or 'none given'}: the sources are {', '.join(SOURCES)}")
    if args.reps < 20:
        p.error("--reps: at least 20 repetitions for a KS test")
    started = time.monotonic()
    results = asyncio.run(run(args.reps, args.samples, args.control, args.seed, sources))
    print(report(results))
    print(f"{args.reps} repetitions of {args.samples} samples in {time.monotonic() - started:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({n: {**asdict(r), "ks": r.ks()} for n, r in results.items()}, indent=1))
    exact = [r for n, r in results.items() if not n.startswith("control")]
    ok = all(uniform_enough(r) for r in exact)
    control_seen = all(not uniform_enough(r) for n, r in results.items() if n.startswith("control"))
    if not control_seen:
        print("the control arm's bias was not seen: the test lacks the power to see it")
    return 0 if ok and control_seen else 1


if __name__ == "__main__":
    sys.exit(main())

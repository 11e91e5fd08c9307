"""``python -m bubblespec.scheduler.sim``: compare scheduling policies on a simulated cluster.

Example::

    python -m bubblespec.scheduler.sim --workers 8,64,512,4096 --requests 65536 --steps 2

For every worker count it simulates each policy on the same seeded workload and prints one
row per policy: figures of the reported steps (all but the first, which has no drafts to use)
and the speedup of the makespan over the ``static`` baseline (no drafts) of the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from bubblespec.scheduler.sim.costs import PROFILES
from bubblespec.scheduler.sim.simulator import SimResult, SimSettings, simulate
from bubblespec.scheduler.sim.workload import AcceptanceModel, LengthModel, Workload

__all__ = ["format_table", "main"]

BASELINE = "static"
POLICIES = ("static", "queue", "queue+drafts", "static+drafts", "longest-first", "longest-first+drafts")
COLUMNS = ("workers", "policy", "makespan_s", "speedup", "fwd/token", "bubble", "drafting", "acc/pass",
           "future_cov", "sim_wall_s")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bubblespec.scheduler.sim", description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="8,64,512", help="comma-separated worker counts")
    p.add_argument("--requests", type=int, default=8192, help="requests per step (prompts x samples)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--steps", type=int, default=2, help="steps per run (step 1 on uses drafts from the one before)")
    p.add_argument("--policies", default="static,queue,queue+drafts,static+drafts",
                   help=f"comma-separated, of: {', '.join(POLICIES)} (the baseline {BASELINE!r} always runs)")
    p.add_argument("--profile", default="gpu-h100-7b", choices=sorted(PROFILES), help="engine cost model")
    p.add_argument("--capacity", type=int, default=256, help="requests per worker at once (max_num_seqs)")
    p.add_argument("--median-tokens", type=float, default=400.0, help="median response length")
    p.add_argument("--max-tokens", type=int, default=8192, help="response length cap")
    p.add_argument("--prompt-sigma", type=float, default=0.7, help="log-space spread of prompt length scales")
    p.add_argument("--sample-sigma", type=float, default=0.6,
                   help="log-space spread of a sample (and a draft) around its prompt's scale")
    p.add_argument("--accept-future", type=float, default=0.7, help="per-token acceptance of future drafts")
    p.add_argument("--train-seconds", type=float, default=0.0,
                   help="simulated time between steps (reward + training); idle workers draft through it")
    p.add_argument("--seed", type=int, default=0)
    return p


def _policy(name: str) -> tuple[str, bool]:
    if name not in POLICIES:
        raise SystemExit(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    base, _, extra = name.partition("+")
    return base, extra == "drafts"


def _row(r: SimResult, baseline: SimResult) -> tuple[str, ...]:
    makespan = r.mean("makespan_seconds")
    cov = sum(s.with_future_draft for s in r.reported) / max(1, sum(s.requests for s in r.reported))
    return (str(r.workers), r.name, f"{makespan:.1f}", f"{baseline.mean('makespan_seconds') / makespan:.2f}x",
            f"{r.mean('forward_passes_per_token'):.3f}", f"{r.mean('bubble_share'):.1%}",
            f"{r.mean('drafting_share'):.1%}", f"{r.mean('accepted_per_pass'):.2f}", f"{cov:.0%}",
            f"{r.wall_seconds:.1f}")


def format_table(rows: Sequence[Sequence[str]]) -> str:
    rows = [COLUMNS, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    workers = [int(w) for w in args.workers.split(",") if w]
    names = [n for n in args.policies.split(",") if n]
    names = [BASELINE] + [n for n in names if n != BASELINE]
    runs = [(n, *_policy(n)) for n in names]
    profile = PROFILES[args.profile]
    workload = Workload(lengths=LengthModel(median_tokens=args.median_tokens, max_tokens=args.max_tokens,
                                            prompt_sigma=args.prompt_sigma, sample_sigma=args.sample_sigma))
    acceptance = replace(AcceptanceModel(), future=args.accept_future)
    settings = SimSettings(capacity=args.capacity, samples=args.samples, train_seconds=args.train_seconds)
    print(f"profile {profile.name} ({profile.source}); {args.requests} requests/step, {args.samples} samples/prompt, "
          f"capacity {args.capacity}, {args.steps} steps, seed {args.seed}", flush=True)
    rows = []
    started = time.perf_counter()
    for w in workers:
        baseline = None
        for name, policy, drafting in runs:
            r = simulate(policy, w, args.requests, args.steps, profile, drafting, args.seed,
                         workload=workload, acceptance=acceptance, settings=settings)
            baseline = baseline or r
            rows.append(_row(r, baseline))
            print(f"  {w} workers, {name}: {r.wall_seconds:.1f} s (adding workers {r.setup_wall_seconds:.1f} s, "
                  f"steps {', '.join(f'{s.wall_seconds:.1f}' for s in r.steps)} s)", file=sys.stderr, flush=True)
    print(format_table(rows))
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

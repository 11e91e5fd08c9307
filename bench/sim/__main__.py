"""``python -m bubblespec.bench.sim``: compare scheduling policies on a simulated cluster.

Example::

    python -m bubblespec.bench.sim --workers 8,64,512,4096 --requests 65536 --steps 2

For every worker count it simulates each policy on the same seeded workload and prints one
row per policy: figures of the reported steps (all but the first, which has no drafts to use)
and the speedup of the makespan over the ``static`` baseline (no drafts) of the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from bubblespec.bench.machine import SpeedProbe, reference_ms
from bubblespec.bench.sim.attribution import format_tail
from bubblespec.bench.sim.costs import CONTEXT_FITS, PROFILES, CostProfile
from bubblespec.bench.sim.reasoning import (REASONING_ACCEPTANCE, REASONING_LENGTHS, REASONING_REQUESTS,
                                            REASONING_SAMPLES, REASONING_WORKLOAD)
from bubblespec.bench.sim.report import closing_lines, sensitivity_lines
from bubblespec.bench.sim.simulator import SimResult, SimSettings, simulate
from bubblespec.bench.sim.workload import AcceptanceModel, LengthModel, Workload
from bubblespec.scheduler.core.settings import CoreSettings

__all__ = ["format_table", "main"]

BASELINE = "static"
POLICIES = ("static", "queue", "queue+drafts", "static+drafts", "longest-first", "longest-first+drafts")
MIN_REQUESTS = 16384
REQUESTS_PER_WORKER = 64
COLUMNS = ("workers", "requests", "policy", "makespan_s", "speedup", "per_seed", "fwd/token", "bubble", "drafting",
           "acc/pass", "future_cov", "sim_wall_s")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bubblespec.bench.sim", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", default="8,64,512", help="comma-separated worker counts")
    p.add_argument("--requests", default="auto",
                   help=f"requests per step (prompts x samples); 'auto': {REQUESTS_PER_WORKER} per worker, at least "
                        f"{MIN_REQUESTS}, so that every worker count gets work for its slots")
    p.add_argument("--workload", choices=("short", "reasoning"), default="short",
                   help="'short': median 400 tokens, cap 8,192, unsourced acceptance; 'reasoning': long reasoning "
                        "rollouts and acceptance by draft source from published figures (bench/sim/reasoning.py): cap "
                        "16,384, ~3%% truncated, 16 samples/prompt, own text / live siblings / future / looping text, "
                        "and a profile with a context-aware fit charges each pass for its KV-cache reads")
    p.add_argument("--samples", type=int, default=None, help="samples per prompt (short: 8, reasoning: 16)")
    p.add_argument("--steps", type=int, default=2, help="steps per run (step 1 on uses drafts from the one before)")
    p.add_argument("--policies", default="static,queue,queue+drafts,static+drafts",
                   help=f"comma-separated, of: {', '.join(POLICIES)} (the baseline {BASELINE!r} always runs)")
    p.add_argument("--profile", default="gpu-h100-7b", choices=sorted(PROFILES), help="engine cost model")
    p.add_argument("--capacity", type=int, default=256, help="requests per worker at once (max_num_seqs)")
    p.add_argument("--median-tokens", type=float, default=None, help="median response length")
    p.add_argument("--max-tokens", type=int, default=None, help="response length cap")
    p.add_argument("--prompt-sigma", type=float, default=None, help="log-space spread of prompt length scales")
    p.add_argument("--sample-sigma", type=float, default=None,
                   help="log-space spread of a sample (and a draft) around its prompt's scale")
    p.add_argument("--accept-future", type=float, default=None, help="per-token acceptance of future drafts")
    p.add_argument("--accept-history", type=float, default=None,
                   help="per-token acceptance of history drafts (an earlier sample of the prompt)")
    p.add_argument("--loop-share", type=float, default=None,
                   help="what-if: share of truncated responses whose last 3,000 tokens loop (own-text acceptance "
                        "0.99, MiniMax-M1); with own-text drafts only (reasoning: default 0)")
    p.add_argument("--epoch-history", type=float, default=0.0,
                   help="what-if: every prompt has its response from an earlier epoch as a history draft, at this mean "
                        "acceptance (RhymeRL, second-hand: 0.65-0.79); 0: off, the first epoch")
    p.add_argument("--context-blind", action="store_true",
                   help="reasoning: keep the profile as named, without its context-aware fit")
    p.add_argument("--sensitivity", action="store_true",
                   help="reasoning: after the table, each acceptance constant at the low and high end of its sources, "
                        "at the first worker count, for static and queue+drafts")
    p.add_argument("--accept-suffix", type=float, default=None,
                   help="what-if: per-token acceptance of self-drafts from a request's own text past the end of its "
                        "draft; 0: off, as the workers' SuffixIndex is. Published for n-gram drafting on RL rollouts "
                        "of Qwen3-8B: at least 0.51-0.60 (docs/SIMULATOR.md); reasoning: Seer's own-text 0.41")
    p.add_argument("--draft-rule", choices=("paying", "fixed"), default="paying" if AcceptanceModel.paying else "fixed",
                   help="draft length: 'paying' drafts the j-th token while acceptance**j exceeds a draft token's cost "
                        "x the batch's tokens/s (off where it costs more than it saves, deep where a pass is "
                        "memory-bound); 'fixed': while acceptance**j >= --min-accept-prob (the worker's DraftLength)")
    p.add_argument("--max-draft-tokens", type=int, default=AcceptanceModel.max_draft_tokens,
                   help="draft tokens per request and pass at most (DraftLength.max_tokens is 8)")
    p.add_argument("--draft-token-budget", type=int, default=AcceptanceModel.token_budget,
                   help="draft tokens one pass verifies over the whole batch at most (DraftLength.token_budget)")
    p.add_argument("--min-accept-prob", type=float, default=AcceptanceModel.min_accept_prob,
                   help="with --draft-rule fixed: draft the j-th token while acceptance**j stays at or above this "
                        "(DraftLength.min_accept_prob)")
    p.add_argument("--train-seconds", type=float, default=0.0,
                   help="simulated time between steps (reward + training); idle workers draft through it")
    p.add_argument("--draft-jobs-beside-requests", type=int, default=CoreSettings.max_draft_jobs_beside_requests,
                   help="draft jobs a busy worker runs beside its requests, for the upcoming prompts predicted "
                        "longest (CoreSettings.max_draft_jobs_beside_requests; 0: drafting only in bubbles and gaps)")
    p.add_argument("--min-requests-beside-draft-jobs", type=int,
                   default=CoreSettings.min_requests_beside_draft_jobs,
                   help="no draft job starts beside fewer requests than this on a worker (its tail), "
                        "CoreSettings.min_requests_beside_draft_jobs; 0: at any count")
    p.add_argument("--draft-beside-first-step", action=argparse.BooleanOptionalAction,
                   default=CoreSettings.draft_beside_first_step,
                   help="draft jobs beside the first step's requests, before completions show whether future "
                        "drafts pay, CoreSettings.draft_beside_first_step (default: %(default)s)")
    p.add_argument("--spread-samples", action=argparse.BooleanOptionalAction, default=CoreSettings.spread_samples,
                   help="hand out the shared queue a request at a time, a prompt's samples spread over the workers "
                        "(Seer), not a sample group at a time, CoreSettings.spread_samples (default: %(default)s)")
    p.add_argument("--min-requests-beside-draft-jobs-at-tail", type=int,
                   default=CoreSettings.min_requests_beside_draft_jobs_at_tail,
                   help="at a step's tail (a worker out of its work), no draft job runs beside fewer requests than "
                        "this on a worker, and idle workers draft their prompts, "
                        "CoreSettings.min_requests_beside_draft_jobs_at_tail; 0: as before the tail")
    p.add_argument("--move-long-requests", action=argparse.BooleanOptionalAction,
                   default=CoreSettings.move_long_requests,
                   help="a worker that runs out of work takes over the running request with the most tokens so far "
                        "from a worker that runs it beside others, and goes on from what it generated, "
                        "CoreSettings.move_long_requests (default: %(default)s)")
    p.add_argument("--min-tokens-to-move", type=int, default=CoreSettings.min_tokens_to_move,
                   help="a request moves only once it has this many tokens, CoreSettings.min_tokens_to_move")
    p.add_argument("--move-to-workers-running-at-most", type=int, default=CoreSettings.move_to_workers_running_at_most,
                   help="in a step without drafts, a worker running at most this many requests and no draft job "
                        "also takes over a long request from a batch more than twice its own, "
                        "CoreSettings.move_to_workers_running_at_most (default: %(default)s; 0: only a worker "
                        "with nothing to run)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (lengths, acceptance); every policy sees the same")
    p.add_argument("--seeds", type=int, default=1,
                   help="run seeds --seed .. --seed+N-1; a row shows medians over them and each seed's speedup")
    p.add_argument("--tail", type=int, default=0,
                   help="makespan attribution: print the last N requests of every reported step (0: off)")
    p.add_argument("--ceiling", default="",
                   help="comma-separated extra drafts per prompt, e.g. 0,8,32,128: print the makespan bound no policy "
                        "can beat with every draft the planner could make complete plus that many more per prompt, and "
                        "the self-draft acceptance 1.8x would need (bench/sim/ceiling.py); '': off")
    return p


def ceiling_lines(args, workload: Workload, acceptance: AcceptanceModel, workers: int, target: float = 1.8) -> list[str]:
    """``--ceiling``: per reported step and drafts per prompt, the bounds of ``ceiling.step_ceiling``
    for ``workers`` workers."""
    from bubblespec.bench.sim.ceiling import step_ceiling

    requests = requests_for(workers, args.requests, args.samples)
    prompts = requests // args.samples
    lines = [f"ceiling, {workers} workers, {requests} requests/step, seed {args.seed} (bench/sim/ceiling.py: floor_s, "
             f"every request alone at batch 1, best draft length, the longest of the planner's drafts, N more, or its "
             f"siblings, at its own acceptance; work_s, the workers' work too; static_min, work_s without drafts)",
             f"  {'step':>4} {'drafts':>6} {'floor_s':>8} {'no-draft':>8} {'bound':>6} {'work_s':>7} {'static_min':>10}  "
             f"{'binding request':<34} self-draft acceptance for {target}x"]
    for step in range(1, args.steps):
        for n in (int(x) for x in args.ceiling.split(",") if x):
            c = step_ceiling(workload, acceptance, PROFILES[args.profile], args.seed, step, prompts, args.samples, n,
                             target, workers)
            name, length, covered, alpha = c.binding
            need = "none reaches it" if c.suffix_needed is None else f"{c.suffix_needed:.2f}"
            lines.append(f"  {step:>4} {n:>6} {c.floor_seconds:8.1f} {c.no_draft_floor_seconds:8.1f} {c.speedup:5.2f}x "
                         f"{c.work_floor_seconds:7.1f} {c.no_draft_work_floor_seconds:10.1f}  "
                         f"{f'{name} {length} tok, {covered} drafted, a={alpha}':<34} {need}")
    return lines


def resolve(args: argparse.Namespace) -> tuple[Workload, AcceptanceModel, CostProfile, str]:
    """The workload, acceptance and profile ``args`` ask for (filling ``args.samples``), and a
    line saying what was chosen. ``--workload short`` is today's defaults, to the bit."""
    reasoning = args.workload == "reasoning"
    lm = REASONING_LENGTHS if reasoning else LengthModel()
    base = REASONING_ACCEPTANCE if reasoning else replace(AcceptanceModel(), future=0.7)

    def pick(value: object, default: object) -> object:
        return default if value is None else value

    if args.samples is None:
        args.samples = REASONING_SAMPLES if reasoning else 8
    if args.samples < 1:
        raise SystemExit("--samples must be >= 1")
    workload = replace(REASONING_WORKLOAD if reasoning else Workload(), lengths=LengthModel(
        median_tokens=pick(args.median_tokens, lm.median_tokens), max_tokens=pick(args.max_tokens, lm.max_tokens),
        prompt_sigma=pick(args.prompt_sigma, lm.prompt_sigma), sample_sigma=pick(args.sample_sigma, lm.sample_sigma)))
    try:
        acceptance = replace(base, future=pick(args.accept_future, base.future),
                             history=pick(args.accept_history, base.history), suffix=pick(args.accept_suffix, base.suffix),
                             loop_share=pick(args.loop_share, base.loop_share), epoch_history=args.epoch_history,
                             paying=args.draft_rule == "paying",
                             max_draft_tokens=args.max_draft_tokens, token_budget=args.draft_token_budget,
                             min_accept_prob=args.min_accept_prob)
    except ValueError as e:
        raise SystemExit(f"acceptance: {e}") from None
    profile = PROFILES[args.profile]
    note = f"workload {args.workload}"
    if reasoning:
        fit = CONTEXT_FITS.get(profile.name)
        if fit is not None and not args.context_blind:
            note += f"; profile {profile.name} charges context: its context-aware fit {fit.name} (bench/sim/costs.py)"
            profile = fit
        note += (f"; acceptance by source (bench/sim/reasoning.py): own text {acceptance.suffix}, siblings "
                 f"{', '.join(f'{n}: {a}' for n, a in acceptance.siblings) or 'off'}, future {acceptance.future}, "
                 f"history {acceptance.history}, looping {acceptance.loop_alpha} over {acceptance.loop_tokens} tokens "
                 f"for {acceptance.loop_share:.0%} of the truncated, history across epochs "
                 f"{acceptance.epoch_history or 'off'}")
    return workload, acceptance, profile, note


def _policy(name: str) -> tuple[str, bool]:
    if name not in POLICIES:
        raise SystemExit(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    base, _, extra = name.partition("+")
    return base, extra == "drafts"


def requests_for(workers: int, requests: str, samples: int, per_worker: int = REQUESTS_PER_WORKER,
                 least: int = MIN_REQUESTS) -> int:
    """Requests per step for ``workers`` workers: ``requests``, or with 'auto' ``per_worker``
    per worker and at least ``least``, rounded up to a multiple of ``samples``."""
    if requests != "auto":
        try:
            return int(requests)
        except ValueError:
            raise SystemExit(f"--requests must be an integer or 'auto', got {requests!r}") from None
    n = max(least, per_worker * workers)
    return -(-n // samples) * samples


def _row(runs: Sequence[SimResult], baselines: Sequence[SimResult]) -> tuple[str, ...]:
    """One table row: medians over the seeds of ``runs``; ``baselines``: static runs of the same seeds."""
    def med(attr: str) -> float:
        return statistics.median(r.mean(attr) for r in runs)

    speedups = [b.mean("makespan_seconds") / r.mean("makespan_seconds") for r, b in zip(runs, baselines)]
    cov = statistics.median(sum(s.with_future_draft for s in r.reported) / max(1, sum(s.requests for s in r.reported))
                            for r in runs)
    r = runs[0]
    return (str(r.workers), str(r.requests_per_step), r.name, f"{med('makespan_seconds'):.1f}",
            f"{statistics.median(speedups):.2f}x", "/".join(f"{x:.2f}" for x in speedups),
            f"{med('forward_passes_per_token'):.3f}", f"{med('bubble_share'):.1%}", f"{med('drafting_share'):.1%}",
            f"{med('accepted_per_pass'):.2f}", f"{cov:.0%}", f"{sum(x.wall_seconds for x in runs):.1f}")


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
    if args.ceiling and args.workload != "short":
        raise SystemExit("--ceiling bounds the short workload's draft sources only (no live siblings, looping text or "
                         "context costs): run it with --workload short")
    workload, acceptance, profile, note = resolve(args)
    sizes = REASONING_REQUESTS if args.workload == "reasoning" else (REQUESTS_PER_WORKER, MIN_REQUESTS)

    def requests(w: int) -> int:
        return requests_for(w, args.requests, args.samples, *sizes)
    settings = SimSettings(capacity=args.capacity, samples=args.samples, train_seconds=args.train_seconds,
                           tail_requests=max(0, args.tail),
                           core=CoreSettings(max_draft_jobs_beside_requests=args.draft_jobs_beside_requests,
                                             min_requests_beside_draft_jobs=args.min_requests_beside_draft_jobs,
                                             draft_beside_first_step=args.draft_beside_first_step,
                                             spread_samples=args.spread_samples,
                                             min_requests_beside_draft_jobs_at_tail=args.min_requests_beside_draft_jobs_at_tail,
                                             move_long_requests=args.move_long_requests,
                                             min_tokens_to_move=args.min_tokens_to_move,
                                             move_to_workers_running_at_most=args.move_to_workers_running_at_most))
    print(f"profile {profile.name} ({profile.source}); requests/step {args.requests}, {args.samples} samples/prompt, "
          f"capacity {args.capacity}, {args.steps} steps, seeds {args.seed}..{args.seed + max(1, args.seeds) - 1}; "
          f"machine reference {reference_ms():.0f} ms (bench/machine.py: lower is faster)", flush=True)
    if args.workload != "short":
        print(note, flush=True)
    rows = []
    closing: list[tuple[int, list[SimResult]]] = []  # the baseline's runs per worker count
    tails: list[str] = []
    started = time.perf_counter()
    seeds = range(args.seed, args.seed + max(1, args.seeds))
    with SpeedProbe() as speed:
        for w in workers:
            baselines: list[SimResult] = []
            for name, policy, drafting in runs:
                results = []
                for seed in seeds:
                    r = simulate(policy, w, requests(w), args.steps, profile, drafting,
                                 seed, workload=workload, acceptance=acceptance, settings=settings)
                    results.append(r)
                    tails += [format_tail(f"{w} workers, {name}, seed {seed}, step {s.summary.step_id} (makespan "
                                          f"{s.makespan_seconds:.1f} s): last {len(s.tail)} requests", s.tail)
                              for s in r.reported if s.tail]
                    print(f"  {w} workers, {name}, seed {seed}: {r.wall_seconds:.1f} s (adding workers "
                          f"{r.setup_wall_seconds:.1f} s, steps {', '.join(f'{s.wall_seconds:.1f}' for s in r.steps)} s)",
                          file=sys.stderr, flush=True)
                baselines = baselines or results
                rows.append(_row(results, baselines))
                if not closing or closing[-1][0] != w:
                    closing.append((w, results))
    print(format_table(rows))
    for t in tails:
        print(t)
    if args.workload != "short":
        for line in closing_lines(closing, workload):
            print(line)
        if args.sensitivity:
            for line in sensitivity_lines(workers[0], requests(workers[0]), args, workload, acceptance, profile, settings):
                print(line, flush=True)
    if args.ceiling:
        for w in workers:
            print("\n".join(ceiling_lines(args, workload, acceptance, w)))
    probed = [ms for samples in speed.samples.values() for _, ms in samples]
    probe = f"{statistics.median(probed):.2f} ms" if probed else "n/a"
    print(f"total {time.perf_counter() - started:.0f} s; the cores' probe {probe} through the rows "
          f"(bench/machine.py: lower is faster)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

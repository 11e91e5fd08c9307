"""``bubblespec bench``: the same synchronous RL steps under four arms, side by side.

Arms (same workers, prompts, seeds and weight updates):

    baseline       static split, no drafts, no straggler watch  (today's data-parallel rollout)
    queue          shared queue, no drafts
    static+drafts  static split with bubble drafts (the BubbleSpec paper's setting)
    bubblespec     shared queue + drafts + straggler watch

Each arm starts from an empty draft store and no length history. Greedy decoding, so that
exactness is checked token by token against the baseline. ``--runs N`` runs the four arms N
times on the same engines (run r starts with the r-th arm, so no arm always goes first) and
reports each run's ratios and their medians. Tells a short story (vLLM's output goes
to a log file unless ``--verbose``), ends with the table and what it means; writes JSON.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bubblespec.bench.machine import SpeedProbe, mean_of_cores, reference_ms
from bubblespec.client import AsyncRolloutClient, SamplingParams, SchedulingPolicy, StepResult
from bubblespec.scheduler.core.settings import CoreSettings

__all__ = ["ARMS", "BenchConfig", "run_bench", "workload_model"]


@dataclass(frozen=True)
class Arm:
    name: str
    policy: SchedulingPolicy
    drafts: bool
    straggler_watch: bool


ARMS = (
    Arm("baseline", SchedulingPolicy.STATIC, False, False),
    Arm("queue", SchedulingPolicy.QUEUE, False, True),
    Arm("static+drafts", SchedulingPolicy.STATIC, True, False),
    Arm("bubblespec", SchedulingPolicy.QUEUE, True, True),
)


@dataclass(frozen=True)
class BenchConfig:
    steps: int = 5
    prompts: int = 32
    samples: int = 2
    max_tokens: int = 480
    ignore_eos: bool = False
    """Decode every response to its ``max_tokens`` (per prompt, if the prompts say): a workload
    whose lengths are set by the caller (tests) rather than by the model."""
    update_scale: float = 3e-5
    """Std of the noise added to every weight between steps, standing in for a gradient step:
    the RMS weight change of one AdamW step of ``examples/grpo_trainer.py`` on this workload
    measured 2.3e-5 to 4.9e-5 (docs/WORKLOAD.md)."""
    lookahead_steps: int = 2
    """Each step announces the prompts of this many following steps, as a trainer that knows
    its data order can (drafted in bubbles and gaps until their step comes)."""
    train_seconds: float = 0.8
    """Pause between a step's end and the next weight push: the trainer's reward and gradient
    time, in which synchronous rollout workers have nothing to do (BubbleSpec drafts). The
    example GRPO trainer's gradient step took 0.5-5.0 s here, median 0.8 s."""
    draft_jobs_during_step: int = -1
    """Draft jobs an idle worker runs while the step's other workers are still busy (the
    scheduler's ``max_draft_jobs_during_step``; -1 = its default, 16, the same width as after
    the step). Measured with 0, 2 and 16 on this machine (docs/BENCHMARKS.md)."""
    draft_jobs_beside_requests: int = -1
    """Draft jobs a busy worker runs beside its requests (the scheduler's
    ``max_draft_jobs_beside_requests``; -1 = its default, 4). Measured with 0, 2, 4, 8 and 16 on
    this machine (docs/BENCHMARKS.md)."""
    draft_beside_first_step: bool = True
    """The scheduler's ``draft_beside_first_step`` (docs/BENCHMARKS.md has both)."""
    spread_samples: bool = False
    """The scheduler's ``spread_samples`` (docs/BENCHMARKS.md has both)."""
    min_requests_beside_draft_jobs_at_tail: int = CoreSettings.min_requests_beside_draft_jobs_at_tail
    """The scheduler's ``min_requests_beside_draft_jobs_at_tail``."""
    move_long_requests: bool = CoreSettings.move_long_requests
    """The scheduler's ``move_long_requests``."""
    min_tokens_to_move: int = CoreSettings.min_tokens_to_move
    """The scheduler's ``min_tokens_to_move``."""
    move_to_workers_running_at_most: int = CoreSettings.move_to_workers_running_at_most
    """The scheduler's ``move_to_workers_running_at_most``."""
    seed: int = 0
    runs: int = 1
    """Times every arm runs (on the same engines, arm order rotated per run); the table gives
    each run's speedup and their median."""

    def __post_init__(self) -> None:
        if self.runs < 1:
            raise ValueError(f"runs must be >= 1, got {self.runs}")


def _step_row(arm: str, step: int, r: StepResult, process_cpu_seconds: float) -> dict:
    s = r.summary
    return {
        "arm": arm, "step": step, "makespan_seconds": s.makespan_seconds, "completions": s.completions,
        "process_cpu_seconds": round(process_cpu_seconds, 4),
        "generated_tokens": s.generated_tokens, "forward_passes": s.provenance.forward_passes,
        "forward_passes_per_token": s.forward_passes_per_token,
        "accepted_per_forward_pass": s.provenance.accepted() / max(1, s.provenance.forward_passes),
        "bubble_share": s.bubble_share, "drafting_worker_seconds": s.drafting_worker_seconds,
        "busy_worker_seconds": s.busy_worker_seconds, "idle_worker_seconds": s.idle_worker_seconds,
        "by_source": {x.source: {"drafted": x.drafted_tokens, "accepted": x.accepted_tokens}
                      for x in s.provenance.sources},
        "requests_moved": s.requests_moved,
        "per_worker": _per_worker(r),
    }


def _worker_done_times(core, step_id: str, per_worker: dict) -> None:
    """Add each worker's ``done_seconds``: when, from the step's start, its last busy spell in
    the step ended (the scheduler's timeline), so the gap to the makespan is its bubble."""
    step = core.step(step_id)
    if step is None or step.finished_at is None:
        return
    for wid, stats in per_worker.items():
        w = core.worker(wid)
        ends = [end for state, since, end in (w.segments if w else ())
                if state == "busy" and end > step.started_at and since < step.finished_at]
        stats["done_seconds"] = round(max(ends, default=step.started_at) - step.started_at, 3)


def _per_worker(r: StepResult) -> dict:
    """Per worker: requests, generated tokens, forward passes of its requests (summed per
    request), and its longest response with that response's forward passes and drafted and
    accepted draft tokens by source: where a step's tail was, how even the split, how far drafts
    carried it (few drafted: the draft was short; many drafted, few accepted: it diverged)."""
    out: dict[str, dict] = {}
    for c in r.completions:
        w = out.setdefault(c.worker_id, {"requests": 0, "tokens": 0, "longest": 0, "forward_passes": 0})
        w["requests"] += 1
        w["tokens"] += len(c.token_ids)
        w["forward_passes"] += c.provenance.forward_passes
        if len(c.token_ids) >= w["longest"]:  # the worker's tail: how far drafts carried it
            w["longest"] = len(c.token_ids)
            w["longest_forward_passes"] = c.provenance.forward_passes
            w["longest_accepted"] = {x.source: x.accepted_tokens for x in c.provenance.sources if x.accepted_tokens}
            w["longest_drafted"] = {x.source: x.drafted_tokens for x in c.provenance.sources if x.drafted_tokens}
    return dict(sorted(out.items()))


async def _run_arm(cluster, client, arm: Arm, prompts, weights, cfg: BenchConfig, version0: int, say=print,
                   probe: SpeedProbe | None = None):
    from bubblespec.store import MemoryStore

    store = MemoryStore()
    for agent in cluster.agents:
        agent.runner.store = store
    cluster.scheduler.core.forget_history()
    rows, outputs = [], []
    sampling = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos)
    for s in range(cfg.steps):
        version = version0 + s
        if s and cfg.train_seconds > 0:
            await asyncio.sleep(cfg.train_seconds)  # the trainer computes rewards and gradients
        await client.update_policy(version, weights[s])
        ahead = [p for t in range(s + 1, s + 1 + cfg.lookahead_steps) if t < len(prompts) for p in prompts[t]]
        cpu, began = time.process_time(), time.monotonic()  # this process: scheduler, agents, trainer, vLLM front ends
        result = await client.generate(f"bench-{arm.name.replace('+', '-')}-{version}", prompts[s], sampling, n=cfg.samples,
                                       policy_version=version, lookahead=ahead, policy=arm.policy,
                                       drafts=arm.drafts, straggler_watch=arm.straggler_watch)
        rows.append(_step_row(arm.name, s + 1, result, time.process_time() - cpu))
        if probe is not None:  # how fast each core ran while the step did (bench/machine.py)
            rows[-1]["core_probe_ms"] = {str(c): ms for c, ms in probe.median_ms(began, time.monotonic()).items()}
        _worker_done_times(cluster.scheduler.core, result.summary.step_id, rows[-1]["per_worker"])
        outputs.append([c.token_ids for c in result.completions])
        say(f"  {arm.name:>13} step {s + 1}: {result.summary.makespan_seconds:6.2f}s "
            f"fwd/tok {result.summary.forward_passes_per_token:.3f}")
    return rows, outputs


def _core_ms(row: dict) -> float | None:
    """A step's core speed: the mean over cores of the probe's median sample (None: no probe)."""
    return mean_of_cores(row.get("core_probe_ms") or {})


def summarize(rows: list[dict], exact: dict[str, bool], first_step: int = 2) -> list[dict]:
    """Per arm, medians over steps >= first_step; speedup = median of per-step ratios to baseline;
    ``speedup_total``: the baseline's time over those steps summed over the arm's (a median of a
    few step ratios can sit between two groups of steps; the sum cannot).
    Where the steps carry the cores' probe (``core_probe_ms``), ``speedup_equal_speed_median``
    is the same ratio with each step's makespan divided by its cores' probe figure: the
    speedup had both steps run on cores of one speed (an estimate: docs/BENCHMARKS.md)."""
    base = {r["step"]: r["makespan_seconds"] for r in rows if r["arm"] == "baseline"}
    base_ms = {r["step"]: _core_ms(r) for r in rows if r["arm"] == "baseline"}
    table = []
    names = [a.name for a in ARMS]
    for arm in sorted(dict.fromkeys(r["arm"] for r in rows), key=lambda a: names.index(a) if a in names else len(names)):
        mine = [r for r in rows if r["arm"] == arm and r["step"] >= first_step] or \
               [r for r in rows if r["arm"] == arm]
        by_source: dict[str, list[int]] = {}
        for r in mine:
            for src, v in r["by_source"].items():
                acc = by_source.setdefault(src, [0, 0])
                acc[0] += v["accepted"]
                acc[1] += v["drafted"]
        drafting = sum(r["drafting_worker_seconds"] for r in mine)
        total = sum(r["drafting_worker_seconds"] + r["busy_worker_seconds"] + r["idle_worker_seconds"] for r in mine)
        equal_speed = [base[r["step"]] / r["makespan_seconds"] * ms / base_ms[r["step"]]
                       for r in mine if (ms := _core_ms(r)) is not None and base_ms.get(r["step"])]
        table.append({
            "arm": arm,
            "makespan_seconds_median": statistics.median(r["makespan_seconds"] for r in mine),
            "speedup_median": statistics.median(base[r["step"]] / r["makespan_seconds"] for r in mine),
            "speedup_total": sum(base[r["step"]] for r in mine) / sum(r["makespan_seconds"] for r in mine),
            "forward_passes_per_token": statistics.median(r["forward_passes_per_token"] for r in mine),
            "accepted_per_forward_pass": statistics.median(r["accepted_per_forward_pass"] for r in mine),
            "bubble_share": statistics.median(r["bubble_share"] for r in mine),
            "drafting_share": drafting / total if total else 0.0,
            "acceptance_by_source": {k: (a / d if d else 0.0) for k, (a, d) in by_source.items()},
            "exact": exact[arm],
        })
        if equal_speed:
            table[-1]["speedup_equal_speed_median"] = statistics.median(equal_speed)
        tails = [t for r in mine if (t := _tail(r)) is not None]
        if tails:
            table[-1]["tail_passes_per_token"] = statistics.median(p for p, _ in tails)
            table[-1]["tail_ms_per_pass"] = statistics.median(ms for _, ms in tails)
    return table


def _tail(row: dict) -> tuple[float, float] | None:
    """The step's tail: on the worker that finished last, its longest request's forward passes
    per token, and that worker's busy time to its end over those passes in ms (what a pass
    took on the path that set the makespan, queueing and prefill included); None without the
    figures."""
    done = [w for w in row.get("per_worker", {}).values() if w.get("done_seconds") and w.get("longest_forward_passes")]
    if not done:
        return None
    last = max(done, key=lambda w: w["done_seconds"])
    return last["longest_forward_passes"] / last["longest"], 1000 * last["done_seconds"] / last["longest_forward_passes"]


def time_split_line(table: list[dict]) -> str:
    """Where each drafting arm's time went against the baseline, on the step's tail (``_tail``):
    its passes fell by one factor, each pass grew by another (verifying drafts), and the
    makespan moved by about their product; '' without the figures."""
    arms = {t["arm"]: t for t in table if "tail_ms_per_pass" in t}
    base = arms.get("baseline")
    if base is None or len(arms) < 2:
        return ""
    parts = []
    for arm, t in arms.items():
        if arm == "baseline":
            continue
        passes = t["tail_passes_per_token"] / base["tail_passes_per_token"]
        per_pass = t["tail_ms_per_pass"] / base["tail_ms_per_pass"]
        parts.append(f"{arm} {t['tail_passes_per_token']:.2f} passes a token ({passes:.2f}x) at "
                     f"{t['tail_ms_per_pass']:.1f} ms ({per_pass:.2f}x): {passes * per_pass:.2f}x the time")
    return (f"The tail (last worker's longest request): baseline {base['tail_passes_per_token']:.2f} passes a token "
            f"at {base['tail_ms_per_pass']:.1f} ms a pass; " + "; ".join(parts))


def table_lines(table: list[dict]) -> list[str]:
    """The summary table: a header and a line per arm."""
    header = (f"{'arm':>13} {'makespan':>9} {'speedup':>8} {'fwd/tok':>8} {'acc/fwd':>8} {'bubble':>7} "
              f"{'drafting':>8} {'exact':>6}  acceptance by source")
    lines = [header]
    for t in table:
        acc = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(t["acceptance_by_source"].items())) or "-"
        runs = t.get("speedup_runs", [])
        each = f"  total {t['speedup_total']:.2f}x" if "speedup_total" in t else ""
        each += f"  runs {' '.join(f'{x:.2f}x' for x in runs)}" if len(runs) > 1 else ""
        lines.append(f"{t['arm']:>13} {t['makespan_seconds_median']:8.2f}s {t['speedup_median']:7.2f}x "
                     f"{t['forward_passes_per_token']:8.3f} {t['accepted_per_forward_pass']:8.2f} "
                     f"{100 * t['bubble_share']:6.1f}% {100 * t['drafting_share']:7.1f}% {t['exact']!s:>6}  {acc}{each}")
    return lines


NUMBERS_EXPLAINED = """\
What the numbers mean (medians over steps >= 2: step 1 has no length history and no drafts announced before it;
  with --runs, the median over runs of each run's figure, and each run's speedup after the table):
  speedup = the baseline's step time / the arm's, total = over the steps summed; fwd/tok = engine forward passes per
  generated token (1.000 without drafts, lower when draft tokens were accepted); acc/fwd = accepted draft tokens per pass;
  bubble = share of worker time idle in the step; exact = every completion token for token the baseline's (greedy)."""


def verdict(table: list[dict]) -> str:
    """One line: how much faster BubbleSpec ran the steps, and whether every arm stayed exact."""
    arms = {t["arm"]: t for t in table}
    inexact = [t["arm"] for t in table if not t["exact"]]
    line = ""
    if "bubblespec" in arms:
        line = f"Here BubbleSpec ran the steps {arms['bubblespec']['speedup_median']:.2f}x as fast as the baseline; "
    if inexact:
        return line + f"NOT EXACT: {', '.join(inexact)} differ from the baseline's outputs (a bug; docs/EXACTNESS.md)."
    return line + "every arm's outputs equal the baseline's, so drafts changed the speed, not the text."


async def run_bench(cluster, prompts: list[list], base_model: str, cfg: BenchConfig, say=print) -> dict:
    """Run every arm ``cfg.runs`` times on ``cluster``, a line per step to ``say``; return the
    JSON-able report: every step's row (with its ``run``), a table per run, and the summary
    (per arm, the median over runs)."""
    from bubblespec.bench.tiny_model import perturb_weights

    rows, outputs = [], {}
    reference = reference_ms()  # the engines up and idle, no arm running yet
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bubblespec-bench-") as tmp, SpeedProbe() as probe:
        weights, current = [], base_model
        for s in range(cfg.steps):  # the same weight sequence for every arm
            current = str(perturb_weights(current, Path(tmp) / f"w{s}", scale=cfg.update_scale, seed=cfg.seed + s))
            weights.append(current)
        stores = [agent.runner.store for agent in cluster.agents]
        try:
            async with AsyncRolloutClient(cluster.target) as client:
                for run in range(cfg.runs):
                    if cfg.runs > 1:
                        say(f" run {run + 1} of {cfg.runs}:")
                    for arm in ARMS[run % len(ARMS):] + ARMS[:run % len(ARMS)]:
                        version0 = cluster.scheduler.core.policy_version + 1
                        arm_rows, outputs[run, arm.name] = await _run_arm(cluster, client, arm, prompts, weights, cfg,
                                                                          version0, say, probe)
                        rows += [{**r, "run": run + 1} for r in arm_rows]
        finally:
            for agent, store in zip(cluster.agents, stores):
                agent.runner.store = store
    # greedy: every run of every arm must give the first baseline run's tokens
    exact = {arm.name: all(outputs[run, arm.name] == outputs[0, "baseline"] for run in range(cfg.runs)) for arm in ARMS}
    per_run = [summarize([r for r in rows if r["run"] == run + 1], exact) for run in range(cfg.runs)]
    differ = differences(outputs, cfg.runs)
    for d in differ:
        say(f"  NOT EXACT: {d['arm']}, run {d['run']}, step {d['step']}, completion {d['completion']}: "
            f"first differs at token {d['at']} of {d['length']} (baseline {d['baseline_length']} tokens)")
    return {"config": cfg.__dict__, "workers": len(cluster.agents), "seconds": time.monotonic() - started,
            "reference_ms": reference, "engine_cores": _engine_cores(cluster),
            "steps": rows, "runs": per_run, "summary": combine_runs(per_run), "differences": differ,
            "draft_cost": [await e.draft_cost() for e in cluster.engines if hasattr(e, "draft_cost")]}


def differences(outputs: dict, runs: int) -> list[dict]:
    """Every completion of every run of every arm whose tokens differ from the first baseline
    run's (greedy: none should), with the first token where they part."""
    out = []
    base = outputs[0, "baseline"]
    for (run, arm), steps in sorted(outputs.items()):
        for step, (mine, ref) in enumerate(zip(steps, base), start=1):
            for i, (a, b) in enumerate(zip(mine, ref)):
                if tuple(a) != tuple(b):
                    at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    out.append({"arm": arm, "run": run + 1, "step": step, "completion": i, "at": at,
                                "length": len(a), "baseline_length": len(b)})
    return out


def core_speed_line(rows: list[dict]) -> str:
    """How fast the cores ran while each arm's steps did: per arm, the median over its steps of
    the mean over cores of the probe's median sample (``core_probe_ms``; '' without a probe).
    An arm whose figure is well above the others' ran on a slower machine, whatever its policy."""
    by_arm: dict[str, list[float]] = {}
    for r in rows:
        ms = _core_ms(r)
        if ms is not None:
            by_arm.setdefault(r["arm"], []).append(ms)
    if not by_arm:
        return ""
    return ("Core speed while each arm ran (probe ms, lower is faster; bench/machine.py): "
            + ", ".join(f"{arm} {statistics.median(v):.2f}" for arm, v in by_arm.items()))


def equal_speed_line(table: list[dict]) -> str:
    """The speedups at equal core speed (``summarize``), per arm but the baseline; '' without them."""
    figures = [f"{t['arm']} {t['speedup_equal_speed_median']:.2f}x" for t in table
               if t["arm"] != "baseline" and "speedup_equal_speed_median" in t]
    if not figures:
        return ""
    return "At equal core speed (each step's makespan over its cores' probe figure): " + ", ".join(figures)


def _engine_cores(cluster) -> dict[str, str]:
    """Worker id -> the cores its engine is bound to (``EngineSettings.cpu_cores``; '' where
    unbound), to read a step's ``core_probe_ms`` by worker."""
    return {f"worker-{i}": getattr(getattr(e, "settings", None), "cpu_cores", "") for i, e in enumerate(cluster.engines)}


def draft_cost_line(costs: list[dict]) -> str:
    """What each engine's paying rule worked with at the end (``VllmEngine.draft_cost``)."""
    def one(c: dict) -> str:
        if not c.get("draft_token_seconds"):
            return f"none yet ({c.get('source', 'no proposer')}: by acceptance)"
        over = f" over {c['steps']} passes" if c["source"] == "measured" else ""
        row = c.get("drafted_request_seconds") or 0.0
        row = f" (+{row:.2g} s a drafted request)" if row > 0 else ""
        return f"{c['draft_token_seconds']:.2g} s{row} {c['source']}{over}"

    return "A draft token's cost, per engine: " + "; ".join(one(c) for c in costs)


def combine_runs(per_run: list[list[dict]]) -> list[dict]:
    """Per arm, the median over runs of each run's figures; ``speedup_runs``: each run's speedup.
    Acceptance by source pools the runs' medians the same way; ``exact`` holds only if it held
    in every run."""
    table = []
    for first in per_run[0]:
        mine = [t for run in per_run for t in run if t["arm"] == first["arm"]]
        keys = dict.fromkeys(k for t in mine for k, v in t.items() if isinstance(v, float))  # a run may lack one
        row = {k: statistics.median(t[k] for t in mine if k in t) for k in keys}
        sources = {src for t in mine for src in t["acceptance_by_source"]}
        row.update(arm=first["arm"], exact=all(t["exact"] for t in mine),
                   acceptance_by_source={src: statistics.median(t["acceptance_by_source"].get(src, 0.0) for t in mine)
                                         for src in sources},
                   speedup_runs=[t["speedup_median"] for t in mine])
        table.append(row)
    return table


def bench_prompts(cfg: BenchConfig) -> list[list]:
    from bubblespec.bench.rlvr import make_prompts

    return [make_prompts(cfg.prompts, seed=cfg.seed * 1000 + s) for s in range(cfg.steps + cfg.lookahead_steps)]


RLVR_MODEL_DIR = Path.home() / ".cache" / "bubblespec" / "rlvr-model"
FIRST_TRAINING = "first run only: 5 to 10 minutes on a two-core CPU, more when it is busy; later runs reuse it"
"""What the first ``bench`` tells the user before it trains the workload model (measured:
docs/BENCHMARKS.md)."""


async def workload_model(say, path: Path = RLVR_MODEL_DIR, settings=None) -> str:
    """The model trained on the RLVR task at ``path``: reused when ``bench.rlvr.is_trained`` says
    it was trained with these settings, else trained there now (in a thread, with progress)."""
    from bubblespec.bench.rlvr import TrainSettings, ensure_trained, is_trained
    from bubblespec.cli.console import ticker

    settings = settings or TrainSettings()
    if is_trained(path, settings=settings):
        say(f"Workload model: {path} (trained by an earlier run).")
        return str(path)
    say(f"Training the workload model into {path} ({FIRST_TRAINING})...")
    tick = asyncio.create_task(ticker(say, "training", 30.0))
    try:
        stats = await asyncio.to_thread(ensure_trained, path, settings=settings)
    finally:
        tick.cancel()
    if stats is not None:
        say(f"  trained in {stats['seconds']:.0f}s (final loss {stats['final_loss']:.3f})")
    return str(path)


def _config(args) -> BenchConfig:
    return BenchConfig(steps=3 if args.quick else args.steps, prompts=16 if args.quick else args.prompts,
                       samples=args.samples, max_tokens=args.max_tokens, lookahead_steps=args.lookahead_steps,
                       train_seconds=args.train_seconds, update_scale=args.update_scale, seed=args.seed,
                       draft_jobs_during_step=args.draft_jobs_during_step,
                       draft_jobs_beside_requests=args.draft_jobs_beside_requests,
                       draft_beside_first_step=args.draft_beside_first_step, spread_samples=args.spread_samples,
                       min_requests_beside_draft_jobs_at_tail=args.min_requests_beside_draft_jobs_at_tail,
                       move_long_requests=args.move_long_requests, min_tokens_to_move=args.min_tokens_to_move,
                       move_to_workers_running_at_most=args.move_to_workers_running_at_most, runs=args.runs)


def _tell_results(say, report: dict, cfg: BenchConfig) -> None:
    say()
    for line in table_lines(report["summary"]):
        say(line)
    say(f"{report['workers']} workers, {cfg.steps} steps x {cfg.prompts} prompts x {cfg.samples} samples, "
        f"{cfg.train_seconds:g}s trainer gap, lookahead {cfg.lookahead_steps} steps, weight updates "
        f"{cfg.update_scale:g} RMS; the arms took {report['seconds']:.0f}s; machine reference "
        f"{report['reference_ms']:.0f} ms (bench/machine.py: lower is faster)")
    if report.get("draft_cost"):
        say(draft_cost_line(report["draft_cost"]))
    for line in (core_speed_line(report["steps"]), equal_speed_line(report["summary"]), time_split_line(report["summary"])):
        if line:
            say(line)
    say()
    say(NUMBERS_EXPLAINED)
    say(verdict(report["summary"]))


def main(args) -> int:
    """``bubblespec bench``: a short story on the terminal, vLLM's output in a log file."""
    from bubblespec.cli.commands import Cluster, _engine_settings, _run_told, _tell_start
    from bubblespec.scheduler.settings import SchedulerSettings

    try:
        cfg = _config(args)
    except ValueError as e:
        print(f"bubblespec bench: {e}", file=sys.stderr)
        return 2

    async def go(story) -> None:
        started = time.monotonic()
        story.say(f"bubblespec bench: the same {cfg.steps} RL steps ({cfg.prompts} prompts x {cfg.samples} samples, "
                  f"greedy) under {len(ARMS)} arms: {', '.join(a.name for a in ARMS)}.")
        args.model = args.model or await workload_model(story.say)
        _tell_start(story, args)
        core = CoreSettings(max_draft_jobs_during_step=None if cfg.draft_jobs_during_step < 0 else cfg.draft_jobs_during_step,
                            draft_beside_first_step=cfg.draft_beside_first_step, spread_samples=cfg.spread_samples,
                            min_requests_beside_draft_jobs_at_tail=cfg.min_requests_beside_draft_jobs_at_tail,
                            move_long_requests=cfg.move_long_requests, min_tokens_to_move=cfg.min_tokens_to_move,
                            move_to_workers_running_at_most=cfg.move_to_workers_running_at_most)
        if cfg.draft_jobs_beside_requests >= 0:
            core = replace(core, max_draft_jobs_beside_requests=cfg.draft_jobs_beside_requests)
        cluster = Cluster(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=0, tokenizer=args.model, core=core),
                          _engine_settings(args), args.workers, progress=story.say)
        await cluster.start()
        story.say(f"Cluster up in {time.monotonic() - started:.0f}s; each arm runs {cfg.steps} steps:")
        try:
            report = await run_bench(cluster, bench_prompts(cfg), args.model, cfg, say=story.say)
        finally:
            t = time.monotonic()
            await cluster.stop()
            story.say(f"Stopped the cluster in {time.monotonic() - t:.0f}s.")
        _tell_results(story.say, report, cfg)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
            story.say(f"Wrote the report (every step, every worker) to {args.json}.")
        story.say(f"The bench took {time.monotonic() - started:.0f}s.")

    return _run_told("bench", args.verbose, go)

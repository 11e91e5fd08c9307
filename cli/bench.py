"""``bubblespec bench``: the same synchronous RL steps under four arms, side by side, one run.

Arms (same workers, prompts, seeds and weight updates):

    baseline       static split, no drafts, no straggler watch  (today's data-parallel rollout)
    queue          shared queue, no drafts
    static+drafts  static split with bubble drafts (the BubbleSpec paper's setting)
    bubblespec     shared queue + drafts + straggler watch

Each arm starts from an empty draft store and no length history. Greedy decoding, so that
exactness is checked token by token against the baseline. Prints a table, writes JSON.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bubblespec.client import AsyncRolloutClient, SamplingParams, SchedulingPolicy, StepResult

__all__ = ["ARMS", "BenchConfig", "run_bench"]


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
    seed: int = 0


def _step_row(arm: str, step: int, r: StepResult) -> dict:
    s = r.summary
    return {
        "arm": arm, "step": step, "makespan_seconds": s.makespan_seconds, "completions": s.completions,
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
    step = core.steps.get(step_id)
    if step is None or step.finished_at is None:
        return
    for wid, stats in per_worker.items():
        w = core.workers.get(wid)
        ends = [end for state, since, end in (w.timeline.segments if w else ())
                if state == "busy" and end > step.started_at and since < step.finished_at]
        stats["done_seconds"] = round(max(ends, default=step.started_at) - step.started_at, 3)


def _per_worker(r: StepResult) -> dict:
    """Per worker: requests, generated tokens, forward passes of its requests (summed per
    request), and its longest response with that response's forward passes and accepted draft
    tokens by source: where a step's tail was, how even the split, how far drafts carried it."""
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
    return dict(sorted(out.items()))


async def _run_arm(cluster, client, arm: Arm, prompts, weights, cfg: BenchConfig, version0: int):
    from bubblespec.store import MemoryStore

    store = MemoryStore()
    for agent in cluster.agents:
        agent.store = store
    cluster.scheduler.core.forget_history()
    rows, outputs = [], []
    sampling = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos)
    for s in range(cfg.steps):
        version = version0 + s
        if s and cfg.train_seconds > 0:
            await asyncio.sleep(cfg.train_seconds)  # the trainer computes rewards and gradients
        await client.update_policy(version, weights[s])
        ahead = [p for t in range(s + 1, s + 1 + cfg.lookahead_steps) if t < len(prompts) for p in prompts[t]]
        result = await client.generate(f"bench-{arm.name.replace('+', '-')}-{version}", prompts[s], sampling, n=cfg.samples,
                                       policy_version=version, lookahead=ahead, policy=arm.policy,
                                       drafts=arm.drafts, straggler_watch=arm.straggler_watch)
        rows.append(_step_row(arm.name, s + 1, result))
        _worker_done_times(cluster.scheduler.core, result.summary.step_id, rows[-1]["per_worker"])
        outputs.append([c.token_ids for c in result.completions])
        print(f"  {arm.name:>13} step {s + 1}: {result.summary.makespan_seconds:6.2f}s "
              f"fwd/tok {result.summary.forward_passes_per_token:.3f}", flush=True)
    return rows, outputs


def summarize(rows: list[dict], exact: dict[str, bool], first_step: int = 2) -> list[dict]:
    """Per arm, medians over steps >= first_step; speedup = median of per-step ratios to baseline."""
    base = {r["step"]: r["makespan_seconds"] for r in rows if r["arm"] == "baseline"}
    table = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
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
        table.append({
            "arm": arm,
            "makespan_seconds_median": statistics.median(r["makespan_seconds"] for r in mine),
            "speedup_median": statistics.median(base[r["step"]] / r["makespan_seconds"] for r in mine),
            "forward_passes_per_token": statistics.median(r["forward_passes_per_token"] for r in mine),
            "accepted_per_forward_pass": statistics.median(r["accepted_per_forward_pass"] for r in mine),
            "bubble_share": statistics.median(r["bubble_share"] for r in mine),
            "drafting_share": drafting / total if total else 0.0,
            "acceptance_by_source": {k: (a / d if d else 0.0) for k, (a, d) in by_source.items()},
            "exact": exact[arm],
        })
    return table


def print_table(table: list[dict]) -> None:
    print(f"\n{'arm':>13} {'makespan':>9} {'speedup':>8} {'fwd/tok':>8} {'acc/fwd':>8} {'bubble':>7} "
          f"{'drafting':>8} {'exact':>6}  acceptance by source")
    for t in table:
        acc = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(t["acceptance_by_source"].items())) or "-"
        print(f"{t['arm']:>13} {t['makespan_seconds_median']:8.2f}s {t['speedup_median']:7.2f}x "
              f"{t['forward_passes_per_token']:8.3f} {t['accepted_per_forward_pass']:8.2f} "
              f"{100 * t['bubble_share']:6.1f}% {100 * t['drafting_share']:7.1f}% {str(t['exact']):>6}  {acc}")


async def run_bench(cluster, prompts: list[list], base_model: str, cfg: BenchConfig) -> dict:
    """Run every arm on ``cluster``; return the JSON-able report."""
    from bubblespec.bench.tiny_model import perturb_weights

    rows, outputs = [], {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bubblespec-bench-") as tmp:
        weights, current = [], base_model
        for s in range(cfg.steps):  # the same weight sequence for every arm
            current = str(perturb_weights(current, Path(tmp) / f"w{s}", scale=cfg.update_scale, seed=cfg.seed + s))
            weights.append(current)
        stores = [agent.store for agent in cluster.agents]
        try:
            async with AsyncRolloutClient(cluster.target) as client:
                for arm in ARMS:
                    version0 = cluster.scheduler.core.version + 1
                    arm_rows, outputs[arm.name] = await _run_arm(cluster, client, arm, prompts, weights, cfg, version0)
                    rows += arm_rows
        finally:
            for agent, store in zip(cluster.agents, stores):
                agent.store = store
    exact = {arm: outputs[arm] == outputs["baseline"] for arm in outputs}
    table = summarize(rows, exact)
    return {"config": cfg.__dict__, "workers": len(cluster.agents), "seconds": time.monotonic() - started,
            "steps": rows, "summary": table}


def bench_prompts(cfg: BenchConfig) -> list[list]:
    from bubblespec.bench.rlvr import make_prompts

    return [make_prompts(cfg.prompts, seed=cfg.seed * 1000 + s) for s in range(cfg.steps + cfg.lookahead_steps)]


RLVR_MODEL_DIR = Path.home() / ".cache" / "bubblespec" / "rlvr-model"


def ensure_rlvr_model(path: Path = RLVR_MODEL_DIR) -> str:
    """The model trained on the arithmetic task, trained here on first use (a few minutes)."""
    if not (path / "model.safetensors").exists():
        from bubblespec.bench.rlvr import train_rlvr_model

        print(f"training the RLVR model into {path} (first run only) ...", flush=True)
        train_rlvr_model(path)
    return str(path)


def main(args) -> None:
    from bubblespec.cli.commands import Cluster, _engine_settings
    from bubblespec.scheduler.core.state import CoreSettings
    from bubblespec.scheduler.settings import SchedulerSettings

    cfg = BenchConfig(steps=3 if args.quick else args.steps, prompts=16 if args.quick else args.prompts,
                      samples=args.samples, max_tokens=args.max_tokens, lookahead_steps=args.lookahead_steps,
                      train_seconds=args.train_seconds, update_scale=args.update_scale, seed=args.seed,
                      draft_jobs_during_step=args.draft_jobs_during_step)
    args.model = args.model or ensure_rlvr_model()

    async def go() -> dict:
        core = CoreSettings(max_draft_jobs_during_step=None if cfg.draft_jobs_during_step < 0 else cfg.draft_jobs_during_step)
        cluster = Cluster(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=0, tokenizer=args.model, core=core),
                          _engine_settings(args), args.workers)
        await cluster.start()
        try:
            return await run_bench(cluster, bench_prompts(cfg), args.model, cfg)
        finally:
            await cluster.stop()

    report = asyncio.run(go())
    print_table(report["summary"])
    print(f"\n{report['workers']} workers, {cfg.steps} steps x {cfg.prompts} prompts x {cfg.samples} samples, "
          f"{cfg.train_seconds:g}s trainer gap, lookahead {cfg.lookahead_steps} steps, weight updates "
          f"{cfg.update_scale:g} RMS; medians over steps >= 2; whole run {report['seconds']:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")

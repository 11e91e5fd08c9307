"""Closing lines of a ``--workload reasoning`` comparison: the workload's shape as drawn, the
baseline's tail share, and the sensitivity of the best arm to each acceptance constant."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import replace

from bubblespec.bench.sim.costs import CostProfile
from bubblespec.bench.sim.reasoning import SENSITIVITY
from bubblespec.bench.sim.simulator import SimResult, SimSettings, simulate
from bubblespec.bench.sim.workload import AcceptanceModel, Workload

__all__ = ["closing_lines", "sensitivity_lines"]

SENSITIVITY_ARM = ("queue", True)
"""The arm the sensitivity table runs against ``static`` (the best drafting arm at the sourced constants)."""


def closing_lines(closing: Sequence[tuple[int, Sequence[SimResult]]], workload: Workload) -> list[str]:
    """Per worker count, from the baseline's runs: responses truncated, mean length, and the share
    of the step the last 10% of requests take (Seer: up to ~50%)."""
    lines = []
    for w, runs in closing:
        steps = [s for r in runs for s in r.reported]
        requests = sum(s.requests for s in steps)
        truncated = sum(s.truncated for s in steps) / max(1, requests)
        tail = statistics.median(s.tail_share for s in steps)
        lines.append(f"{w} workers, {runs[0].name} (baseline): the last 10% of requests take {tail:.0%} of the step "
                     f"(median of {len(steps)} reported step(s)); {truncated:.1%} of responses reach the "
                     f"{workload.lengths.max_tokens}-token cap; {runs[0].requests_per_step} requests/step")
    return lines


def sensitivity_lines(workers: int, requests: int, args: argparse.Namespace, workload: Workload,
                      acceptance: AcceptanceModel, profile: CostProfile, settings: SimSettings) -> list[str]:
    """``--sensitivity``: the speedup of ``SENSITIVITY_ARM`` over ``static`` with each acceptance
    constant at the low and high end of its sources (the others at the run's values)."""
    policy, drafting = SENSITIVITY_ARM

    def run(pol: str, d: bool, acc: AcceptanceModel, prof: CostProfile = profile) -> float:
        return simulate(pol, workers, requests, args.steps, prof, d, args.seed, workload=workload, acceptance=acc,
                        settings=settings).mean("makespan_seconds")

    static = run("static", False, acceptance)
    lines = [f"sensitivity, {workers} workers, {requests} requests/step, seed {args.seed}: speedup of "
             f"{policy}+drafts over static ({static:.1f} s)",
             f"  {'constant':<13} {'low':>6} {'high':>6}  range of its sources"]
    for name, (what, low, high) in SENSITIVITY.items():
        lo, hi = (static / run(policy, drafting, replace(acceptance, **a)) for a in (low, high))  # type: ignore[arg-type]
        lines.append(f"  {name:<13} {lo:5.2f}x {hi:5.2f}x  {what}")
    return lines


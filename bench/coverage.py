"""Draft coverage of a bench step's longest response, against the passes that could draft it.

A draft job is a sequential generation: each forward pass of the engine it runs on adds one
token to it. A response of ``L`` tokens is drafted in full only if its job saw ``L`` passes
between the prompt's announcement and its step. With no trainer's gap (``bench
--train-seconds 0``) those passes are the passes of the steps in between: with a lookahead of
``m`` steps, the ``m`` steps before, about as many passes each as its longest response took.
So a fast step (its longest response drafted, a few passes) leaves the next ones little to
draft with.

:func:`longest_coverage` reads a ``bench --json`` report (``per_worker`` of every step row) and
gives, per run and step of an arm: the step's longest response, how many of its tokens came
from accepted drafts, and the forward passes of the ``m`` steps before it (each step's is its
longest request's, the most of any worker's). ``python -m bubblespec.bench.coverage
REPORT.json...`` prints the rows' summary: the steps whose longest response came drafted
(at least ``FULL`` of its tokens from accepted drafts) against those that did not.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["FULL", "LongestCoverage", "longest_coverage", "summarize"]

FULL = 0.9
"""A response "came drafted" when at least this share of its tokens were accepted drafts."""


@dataclass(frozen=True)
class LongestCoverage:
    """One step of one run of an arm, and its longest response."""

    run: int
    step: int
    length: int
    """Tokens of the step's longest response."""
    accepted: int
    """Its tokens that were accepted draft tokens (any source)."""
    drafted: int
    """Draft tokens proposed to it."""
    passes_before: int
    """Forward passes of the ``lookahead`` steps before this one (each: its longest request's)."""
    speedup: float
    """The baseline's makespan of the same run and step over this one's."""

    @property
    def drafted_in_full(self) -> bool:
        return self.accepted >= FULL * self.length


def _step_passes(row: dict) -> int:
    return max((p["longest_forward_passes"] for p in row["per_worker"].values()), default=0)


def longest_coverage(report: dict, arm: str = "bubblespec") -> list[LongestCoverage]:
    """The rows of ``arm`` (steps with ``lookahead`` steps before them, so every one has a
    full window); the lookahead is the report's ``config.lookahead_steps``."""
    lookahead = int(report["config"]["lookahead_steps"])
    rows = report["steps"]
    out = []
    for run in sorted({r["run"] for r in rows}):
        mine = {r["step"]: r for r in rows if r["run"] == run and r["arm"] == arm}
        base = {r["step"]: r for r in rows if r["run"] == run and r["arm"] == "baseline"}
        for step in sorted(mine):
            window = [step - j for j in range(1, lookahead + 1)]
            if not all(s in mine for s in window) or step not in base:
                continue
            longest = max(mine[step]["per_worker"].values(), key=lambda p: p["longest"])
            out.append(LongestCoverage(
                run=run, step=step, length=longest["longest"],
                accepted=sum(longest["longest_accepted"].values()), drafted=sum(longest["longest_drafted"].values()),
                passes_before=sum(_step_passes(mine[s]) for s in window),
                speedup=base[step]["makespan_seconds"] / mine[step]["makespan_seconds"]))
    return out


def summarize(rows: Iterable[LongestCoverage]) -> str:
    """Steps whose longest response came drafted against the others: how many, their median
    speedup, the median length of that response and the median passes before the step."""
    rows = list(rows)
    lines = [f"{len(rows)} steps; longest response drafted in full: at least {FULL:.0%} of its tokens accepted drafts"]
    for name, group in (("drafted in full", [r for r in rows if r.drafted_in_full]),
                        ("partly drafted", [r for r in rows if not r.drafted_in_full])):
        if not group:
            lines.append(f"  {name:16}: none")
            continue
        lines.append(f"  {name:16}: {len(group):4d} steps, speedup median {statistics.median(r.speedup for r in group):.2f}x, "
                     f"longest response median {statistics.median(r.length for r in group):.0f} tokens, "
                     f"passes of the steps before median {statistics.median(r.passes_before for r in group):.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m bubblespec.bench.coverage REPORT.json [REPORT.json ...]", file=sys.stderr)
        return 2
    rows: list[LongestCoverage] = []
    for path in paths:
        with open(path) as f:
            rows += longest_coverage(json.load(f))
    print(summarize(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""JSON-able snapshot of the core for ``/status``, the ``Status`` RPC and the UI."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bubblespec.scheduler.core.state import SchedulerCore, StepState, WorkerState

__all__ = ["snapshot"]


def _worker(w: WorkerState, now: float) -> dict:
    return {
        "worker_id": w.hello.worker_id,
        "state": w.state,
        "policy_version": w.version,
        "loading": w.loading,
        "load_failed": w.load_failed,
        "running": len(w.running),
        "queued": len(w.private),
        "drafting": len(w.drafts),
        "capacity": w.capacity,
        "speculation": w.hello.speculation,
        "tokens_per_second": round(w.tokens_per_second, 2),
        "seconds": {"busy": w.timeline.busy, "idle": w.timeline.idle, "drafting": w.timeline.drafting},
        "timeline": [[s, a, b] for s, a, b in w.timeline.segments] + [[w.state, w.state_since, now]],
    }


def _step(s: StepState, now: float) -> dict:
    out = {
        "step_id": s.spec.step_id,
        "policy_version": s.spec.policy_version,
        "policy": s.spec.policy.value,
        "requests": len(s.requests),
        "completed": len(s.completions),
        "queued": len(s.shared),
        "started_at": s.started_at,
        "finished_at": s.finished_at,
        "elapsed_seconds": (s.finished_at or now) - s.started_at,
        "cancelled": s.cancelled,
    }
    if s.summary is not None:
        summary = asdict(s.summary)
        summary["forward_passes_per_token"] = s.summary.forward_passes_per_token
        summary["bubble_share"] = s.summary.bubble_share
        out["summary"] = summary
    return out


def snapshot(core: SchedulerCore) -> dict:
    now = core.clock()
    covered, announced = core.planner.coverage()
    return {
        "now": now,
        "policy_version": core.version,
        "workers": [_worker(w, now) for w in core.workers.values()],
        "steps": [_step(s, now) for s in core.steps.values()],
        "requests_waiting": sum(len(s.shared) for s in core.steps.values() if s.active)
        + sum(len(w.private) for w in core.workers.values()),
        "requests_running": sum(len(w.running) for w in core.workers.values()),
        "drafts": {"prompts_covered": covered, "prompts_announced": announced},
    }

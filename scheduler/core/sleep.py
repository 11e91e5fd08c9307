"""vLLM's sleep mode over many workers (pure): which workers sleep, at what level, and what
that means for dispatch, draft jobs and the workers' weights. The shell
(``scheduler/sleep_api.py``) pauses dispatch and fans ``/sleep`` and ``/wake_up`` out to every
worker; this module decides what the scheduler does meanwhile.

- Asleep, a worker's engine serves nothing (as vLLM's engine, whose scheduler is paused while
  it sleeps): it gets no request and no draft job (its running draft jobs are stopped when it
  falls asleep). Dispatch as a whole is paused with the sleep's ``mode`` (``core/pause.py``):
  a call that arrives meanwhile waits, as vLLM accepts requests while asleep and runs them once
  it is awake again; ``/wake_up`` that leaves every worker fully awake resumes dispatch.
- Level 1 offloads the weights and keeps them: the workers serve their version again on
  waking. Level 2 discards them: each sleeping worker serves no version (-1, weights unknown)
  until a weight update succeeds on it (weight transfer or ``/update_weights``); the cluster's
  version does not move. Level 0 only pauses (vLLM's level 0).
- Drafts held in the draft store stay: a draft is only a proposal, verified token by token by
  whatever policy serves next (docs/EXACTNESS.md), so drafts made under weights that a level-2
  sleep discarded can still be proposed; they never decide an output.
- A worker that joins while the others sleep is awake (a fresh engine); dispatch stays paused.
- Sleep is refused while a policy update is loading (``load_policy`` or weight transfer's
  ``start`` .. ``finish``): its barrier waits on the workers' answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bubblespec.scheduler.core.types import Action, ErrorCode, InvalidRequest

if TYPE_CHECKING:
    from bubblespec.scheduler.core.state import SchedulerCore

__all__ = ["SLEEP_LEVELS", "WAKE_TAGS", "EngineSleep"]

SLEEP_LEVELS = (0, 1, 2)
"""vLLM 0.32's ``/sleep?level=`` values."""
WAKE_TAGS = ("weights", "kv_cache", "scheduling")
"""vLLM 0.32's ``/wake_up?tags=`` values (none: everything)."""


class EngineSleep:
    """The workers asleep and the deepest level they sleep at."""

    def __init__(self, core: SchedulerCore):
        self.core = core
        self.level: int | None = None
        """The deepest level of the sleep in progress; None when awake."""

    @property
    def asleep(self) -> bool:
        return self.level is not None

    def check_level(self, level: int) -> None:
        if level not in SLEEP_LEVELS:
            raise InvalidRequest("level", f"must be one of {', '.join(map(str, SLEEP_LEVELS))}, got {level!r:.20}")

    def check_can_sleep(self, level: int, updating: int | None) -> None:
        """Refuse a bad level, or a sleep while a policy update is loading (``updating``: the
        weight-transfer update in progress, if any)."""
        self.check_level(level)
        version = updating if updating is not None else self.core.versions.updating
        if version is not None:
            raise InvalidRequest("level", f"the update to policy version {version} is in progress: finish it (or "
                                 "POST /abort_weight_update) before /sleep", ErrorCode.FAILED_PRECONDITION)

    def sleep(self, level: int) -> list[Action]:
        """Every live worker falls asleep at ``level`` (dispatch is already paused): its draft
        jobs stop; at level 2 its weights are gone (version -1)."""
        self.check_level(level)
        core = self.core
        self.level = max(level, self.level or 0)
        actions: list[Action] = []
        now = core.clock()
        for w in core.workers.values():
            w.asleep = True
            actions += core.drafts.stop(w)
            if level == 2:
                w.version = -1
            core.timing.set_state(w, now)
        return actions

    def wake(self) -> list[Action]:
        """Every worker is fully awake: each takes work again (dispatch resumes in the shell)."""
        self.level = None
        for w in self.core.workers.values():
            w.asleep = False
        return self.core.dispatcher.fill_all()


def check_tags(tags: list[str]) -> list[str] | None:
    """``/wake_up``'s ``tags`` (repeated query parameter): None for all; an unknown tag is refused."""
    for tag in tags:
        if tag not in WAKE_TAGS:
            raise InvalidRequest("tags", f"each tag must be one of {', '.join(WAKE_TAGS)}, got {tag!r:.40}")
    return list(tags) or None

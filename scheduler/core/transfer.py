"""vLLM's weight-transfer protocol over many workers (pure): one trainer group, each worker's
rank offset, and the policy version the transferred weights become.

A trainer that syncs weights into vLLM over NCCL (TRL, SkyRL) opens one process group with
the inference ranks (``POST /init_weight_transfer_engine {init_info}``) and then, per
update, ``/start_weight_update`` -> ``/update_weights {update_info}`` (one or more) ->
``/finish_weight_update {weight_version}``. BubbleSpec's workers are separate vLLM engines,
so every call is fanned out to each of them (the shell: ``scheduler/weight_transfer.py``);
this module decides what each worker gets and what the outcome means.

- Rank mapping: the trainer's ``init_info`` has ``rank_offset`` R (its own ranks come first)
  and ``world_size`` W. Workers, sorted by id, get offsets R, R + tp0, R + tp0 + tp1, ...
  (tp: the worker's tensor-parallel size, its ranks in the group); W must be R + sum(tp).
- The worker set is frozen at init: a worker that joined later is not in the trainer's group
  and a worker lost since (or reconnected: its stream is new) may have missed part of it, so
  the next call fails naming it; ``init_weight_transfer_engine`` again starts a new group.
- Versions: ``start`` opens the policy barrier of ``SchedulerCore`` for version current+1
  without loading anything (dispatch stops: no request runs on half-updated weights; a new
  step is refused as during any update); ``finish`` answers the barrier for every member, so
  the version moves (``PolicyReady``, journaled) only when all of them finished. Its weights
  path is ``weight-transfer:<weight_version or version>``: a label, not a directory. A failed
  call ends the barrier (``PolicyFailed``): the version stays, and members whose weights were
  in flux serve nothing (version -1, as after a failed load) until an update succeeds.
- Updates that never finish: an update started and not finished within ``deadline_seconds``
  (``SchedulerSettings.weight_update_deadline_seconds``, by the core's clock: ``expire``, which
  the shell calls periodically) ends as a failed call does, with an error naming the deadline;
  ``abort`` does the same at once (``POST /abort_weight_update``). Either way the barrier ends
  with ``PolicyFailed`` (every waiter gets the reason), the cluster's version stays, and every
  member serves nothing (version -1) until an update succeeds: its weights may be partly
  replaced. ``unclosed`` names the members whose engine may still hold the update open (they
  answered ``start``): the shell closes it there (``CONTROL_OP_ABORT_WEIGHT_UPDATE``), so the
  next ``start`` is not refused by vLLM as "already active".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bubblespec.scheduler.core.types import Action, ErrorCode, InvalidRequest

if TYPE_CHECKING:
    from bubblespec.scheduler.core.state import SchedulerCore, WorkerState

__all__ = ["DEFAULT_DEADLINE_SECONDS", "TRANSFER_PREFIX", "Member", "WeightTransfer"]

TRANSFER_PREFIX = "weight-transfer:"
"""Weights path of a version pushed by weight transfer (no directory holds it)."""
DEFAULT_DEADLINE_SECONDS = 600.0
"""How long a started weight update may stay open before it is rolled back."""


@dataclass(frozen=True)
class Member:
    """A worker of the trainer's group: its first rank and how many it has."""

    worker_id: str
    rank_offset: int
    tensor_parallel_size: int


class WeightTransfer:
    """The trainer's weight-transfer group and the update in progress, if any."""

    def __init__(self, core: SchedulerCore, deadline_seconds: float = DEFAULT_DEADLINE_SECONDS):
        if not deadline_seconds > 0:
            raise ValueError(f"weight_update_deadline_seconds: must be > 0, got {deadline_seconds!r}")
        self.core = core
        self.deadline_seconds = deadline_seconds
        """A started update not finished within this many seconds (core clock) is rolled back."""
        self.started_at = 0.0
        """When the update in progress started (core clock)."""
        self.unclosed: set[str] = set()
        """Members whose engine may hold an update open that the scheduler ended (the shell closes it)."""
        self.rolled_back = ""
        """Why the latest update was rolled back ('' when none was, or one started since)."""
        self.members: dict[str, Member] = {}
        """The group, frozen at init (worker id -> its ranks); empty before the first init."""
        self.updating: int | None = None
        """The version a started update becomes at finish; None outside start .. finish."""
        self._joined: dict[str, WorkerState] = {}  # member -> its state at init (a reconnect is a new one)

    # ------------------------------------------------------------------- init --

    def plan_init(self, init_info: Any) -> dict[str, dict]:
        """Each live worker's ``init_info`` (the trainer's, with the worker's own rank offset);
        refuses a bad one naming the field. Changes nothing: ``commit_init`` once all agreed."""
        if not isinstance(init_info, dict):
            raise InvalidRequest("init_info", "must be a JSON object")
        if self.updating is not None:
            raise InvalidRequest("init_info", f"the weight update to version {self.updating} is in progress; "
                                 "finish it first", ErrorCode.FAILED_PRECONDITION)
        offset = _count(init_info, "rank_offset")
        world = _count(init_info, "world_size")
        workers = sorted(self.core.workers.values(), key=lambda w: w.hello.worker_id)
        if not workers:
            raise InvalidRequest("workers", "no worker is connected to join the weight-transfer group", ErrorCode.UNAVAILABLE)
        ranks = sum(w.hello.tensor_parallel_size for w in workers)
        if world != offset + ranks:
            raise InvalidRequest("init_info.world_size", f"must be rank_offset {offset} + the ranks of the "
                                 f"{len(workers)} connected worker(s) {ranks} = {offset + ranks}, got {world}")
        plan: dict[str, dict] = {}
        for w in workers:
            plan[w.hello.worker_id] = {**init_info, "rank_offset": offset}
            offset += w.hello.tensor_parallel_size
        return plan

    def commit_init(self, plan: dict[str, dict]) -> None:
        """Every worker of ``plan`` joined the group: it is the one later calls go to."""
        core = self.core
        self.members = {wid: Member(wid, info["rank_offset"], core.workers[wid].hello.tensor_parallel_size)
                        for wid, info in plan.items() if wid in core.workers}
        self._joined = {wid: core.workers[wid] for wid in self.members}

    def reset(self) -> None:
        """Forget the group (a failed init: the trainer must init again)."""
        self.members, self._joined = {}, {}

    # ---------------------------------------------------------------- checks --

    def check_members(self) -> None:
        """Refuse when the live workers are not the group frozen at init, naming the odd one."""
        if not self.members:
            raise InvalidRequest("init_info", "no weight-transfer group: call /init_weight_transfer_engine first",
                                 ErrorCode.FAILED_PRECONDITION)
        workers = self.core.workers
        for wid, m in sorted(self.members.items()):
            if workers.get(wid) is not self._joined[wid]:
                why = "left" if wid not in workers else "reconnected"
                raise InvalidRequest("workers", f"worker {wid} (rank_offset {m.rank_offset}) {why} after "
                                     "init_weight_transfer_engine and may have missed weights; call "
                                     "/init_weight_transfer_engine again", ErrorCode.FAILED_PRECONDITION)
        for wid in sorted(set(workers) - set(self.members)):
            raise InvalidRequest("workers", f"worker {wid} joined after init_weight_transfer_engine: it is not in "
                                 "the trainer's group and never gets its weights; call "
                                 "/init_weight_transfer_engine again", ErrorCode.FAILED_PRECONDITION)

    def plan_update(self, update_info: Any) -> dict[str, Any]:
        """Each member's ``update_info``: the trainer's object, or its slice of a list (vLLM
        indexes a list by the worker's rank in the group minus ``rank_offset``)."""
        if isinstance(update_info, dict):
            return {wid: update_info for wid in self.members}
        ranks = sum(m.tensor_parallel_size for m in self.members.values())
        if not isinstance(update_info, list) or not all(isinstance(x, dict) for x in update_info):
            raise InvalidRequest("update_info", "must be a JSON object or a list of objects (one per worker rank)")
        if len(update_info) != ranks:
            raise InvalidRequest("update_info", f"a list must have one object per worker rank of the group, {ranks}, "
                                 f"got {len(update_info)}")
        base = min(m.rank_offset for m in self.members.values())
        return {wid: update_info[m.rank_offset - base:m.rank_offset - base + m.tensor_parallel_size]
                for wid, m in self.members.items()}

    def check_updating(self, call: str) -> int:
        if self.updating is None:
            why = f" (the last one ended: {self.rolled_back})" if self.rolled_back else ""
            raise InvalidRequest("weight_version" if call == "finish" else "update_info",
                                 f"no weight update is in progress{why}: call /start_weight_update first",
                                 ErrorCode.FAILED_PRECONDITION)
        return self.updating

    # ---------------------------------------------------------------- update --

    def start(self) -> tuple[int, list[Action]]:
        """Open the barrier for the next version through the core's one command for a version
        change (``SchedulerCore.update_policy``: no weights to load, the trainer pushes them to
        the members), stopping dispatch and draft jobs on every member. Refused while a step
        runs (unless a ``keep`` pause holds it) or another update is in progress."""
        core = self.core
        self.check_members()
        if self.updating is not None:
            raise InvalidRequest("weight_version", f"the weight update to version {self.updating} is already in "
                                 "progress; finish it first", ErrorCode.ALREADY_EXISTS)
        version = core.policy_version + 1  # its label names it before finish does (the core checks it is the next)
        actions = core.update_policy(version, f"{TRANSFER_PREFIX}{version}", "weight_version", pushed_to=list(self.members))
        self.updating, self.started_at = version, core.clock()
        self.unclosed, self.rolled_back = set(), ""
        return version, actions

    def started(self, answers: dict[str, str | None]) -> None:
        """``start`` reached the members (worker -> None, or its error): those that took it hold
        an open update in their engine until finish (or the shell closes it, ``unclosed``)."""
        self.unclosed = {wid for wid, e in answers.items() if e is None and wid in self.members}

    def overdue(self) -> float | None:
        """Seconds the update in progress has run past its deadline (>= 0), else None."""
        if self.updating is None:
            return None
        late = self.core.clock() - self.started_at - self.deadline_seconds
        return late if late >= 0 else None

    def expire(self) -> list[Action]:
        """Roll back the update in progress if it outlived its deadline (the trainer died, or
        never called finish): the same outcome as ``abort``, with the deadline as the reason."""
        if self.overdue() is None:
            return []
        return self.abort({}, f"the weight update to version {self.updating} was not finished within "
                              f"{self.deadline_seconds:g}s (weight_update_deadline_seconds) and was rolled back; "
                              f"the cluster stays at version {self.core.version}")

    def finish(self, label: str, answers: dict[str, str | None]) -> list[Action]:
        """Members answered ``finish_weight_update`` (worker -> None, or its error): every one
        finished -> the version is the cluster's (weights path ``weight-transfer:<label>``);
        else it stays, and a member that failed serves nothing until an update succeeds."""
        version = self.check_updating("finish")
        core = self.core
        core.versions.label(version, f"{TRANSFER_PREFIX}{label or version}")
        self.updating = None
        self.unclosed = {wid for wid in self.unclosed if answers.get(wid, "") is not None}  # finished: closed
        actions: list[Action] = []
        for wid in sorted(self.members):
            error = answers.get(wid, "did not answer finish_weight_update")
            actions += core.versions.loaded(wid, version, error is None, error or "", weights_unknown=error is not None)
        return actions + core.versions.close(version)  # members that left kept it open

    def abort(self, answers: dict[str, str | None], reason: str = "") -> list[Action]:
        """``start`` or ``update`` failed on a member (worker -> its error; None: it succeeded),
        or the group broke (``reason``): the update is over and failed; every member's weights
        are in flux, so none serves until an update succeeds. Members that took ``start`` stay
        in ``unclosed`` (their engine holds the update open)."""
        version = self.updating
        if version is None:
            return []
        failed = ", ".join(sorted(wid for wid, e in answers.items() if e is not None)) or "a worker"
        self.updating = None
        self.rolled_back = reason or f"{failed} failed"
        actions: list[Action] = []
        for wid in sorted(self.members):
            error = answers.get(wid) or reason or f"the weight update was abandoned ({failed} failed)"
            actions += self.core.versions.loaded(wid, version, False, error, weights_unknown=True)
        return actions + self.core.versions.close(version)  # members that left kept it open


def _count(init_info: dict, name: str) -> int:
    value = init_info.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest(f"init_info.{name}", f"must be an integer >= 0, got {value!r:.40}")
    return value

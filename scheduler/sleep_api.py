"""vLLM's sleep-mode routes on the scheduler's HTTP port, fanned out to every worker
(docs/INTEGRATIONS.md; what sleep means for dispatch, weights and drafts: ``core/sleep.py``).

- ``POST /sleep?level=0|1|2&mode=abort|wait|keep`` -> ``{"status": "sleeping", "level": L}``
  (vLLM 0.32's defaults: level 1, mode abort): dispatch pauses with ``mode`` (``/pause``'s
  modes), every worker stops its draft jobs and its engine sleeps. A call that arrives while
  asleep waits and runs after the wake-up, as vLLM accepts requests while asleep. A worker
  that fails to sleep is named (HTTP 500); the scheduler stays asleep (``/wake_up`` wakes all).
- ``POST /wake_up?tags=weights&tags=kv_cache`` (none: all; vLLM's tags ``weights``,
  ``kv_cache``, ``scheduling``) -> ``{"status": "awake" | "sleeping", "tags": [...] | null}``:
  every worker's engine wakes what ``tags`` name; once all of them are fully awake, dispatch
  resumes (vLLM resumes its scheduler then, also after a plain ``/pause``).
- ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``: asleep, or dispatch paused (vLLM answers
  true for a paused engine too).

Refused while a policy update is loading (409), and ``/resume`` is refused while asleep (409):
the engines would not serve. Each takes the trainer token when the scheduler has one.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.scheduler import weight_transfer
from bubblespec.scheduler.core.pause import PAUSE_MODES
from bubblespec.scheduler.core.sleep import EngineSleep, check_tags
from bubblespec.scheduler.core.types import ErrorCode, InvalidRequest
from bubblespec.scheduler.openai_api import unauthorized

if TYPE_CHECKING:
    from bubblespec.scheduler.app import SchedulerApp

__all__ = ["create_router", "sleep_of"]

_sleeps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # service -> its EngineSleep
_SLEEP_PARAMS = ("level", "mode")


def sleep_of(scheduler: SchedulerApp) -> EngineSleep:
    """The scheduler's sleep state (one per service)."""
    service = scheduler.service
    if service not in _sleeps:
        _sleeps[service] = EngineSleep(service.core)
    return _sleeps[service]


def _level(request: Request) -> int:
    raw = request.query_params.get("level", "1")
    try:
        return int(raw)
    except ValueError:
        raise InvalidRequest("level", f"must be 0, 1 or 2, got {raw!r:.20}") from None


async def _sleep(scheduler: SchedulerApp, request: Request) -> dict:
    for name in request.query_params:
        if name not in _SLEEP_PARAMS:
            raise InvalidRequest(name, f"{name} is not a parameter of vLLM 0.32's /sleep (level, mode)")
    level, mode = _level(request), request.query_params.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise InvalidRequest("mode", f"must be one of {', '.join(PAUSE_MODES)}, got {mode!r:.40}")
    service, sleep = scheduler.service, sleep_of(scheduler)
    sleep.check_can_sleep(level, service.transfer.updating)
    if not await service.pause(mode):
        raise InvalidRequest("mode", "the scheduler was resumed (POST /resume) before the active steps ended",
                             ErrorCode.FAILED_PRECONDITION)
    sleep.check_can_sleep(level, service.transfer.updating)  # a policy update may have begun while waiting
    service.execute(sleep.sleep(level))
    args = {wid: {"level": level} for wid in service.links}
    answers = await weight_transfer.fan_out(scheduler, "sleep", pb.CONTROL_OP_SLEEP, args)
    if not all(a.ok for a in answers.values()):
        raise weight_transfer.WorkersFailed("sleep", answers)
    return {"status": "sleeping", "level": level}


async def _wake_up(scheduler: SchedulerApp, request: Request) -> dict:
    for name in request.query_params:
        if name != "tags":
            raise InvalidRequest(name, f"{name} is not a parameter of vLLM 0.32's /wake_up (tags)")
    tags = check_tags(request.query_params.getlist("tags"))
    service, sleep = scheduler.service, sleep_of(scheduler)
    args = {wid: {"tags": tags} for wid in service.links}
    answers = await weight_transfer.fan_out(scheduler, "wake_up", pb.CONTROL_OP_WAKE_UP, args)
    if not all(a.ok for a in answers.values()):
        raise weight_transfer.WorkersFailed("wake_up", answers)
    awake = all(a.result.get("fully_awake") is True for a in answers.values())
    if awake:
        service.execute(sleep.wake())
        service.resume()
    return {"status": "awake" if awake else "sleeping", "tags": tags}


def create_router(scheduler: SchedulerApp) -> APIRouter:
    router = APIRouter()

    async def answer(request: Request, call: Callable[[SchedulerApp, Request], Awaitable[dict]]) -> Response:
        if (refusal := unauthorized(scheduler, request)) is not None:
            return refusal
        try:
            async with weight_transfer.calls_lock(scheduler):  # not beside a weight-transfer call
                return JSONResponse(await call(scheduler, request))
        except InvalidRequest as exc:
            return weight_transfer.error(exc)

    @router.post("/sleep")
    async def sleep(request: Request) -> Response:
        return await answer(request, _sleep)

    @router.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        return await answer(request, _wake_up)

    @router.get("/is_sleeping")
    async def is_sleeping(request: Request) -> Response:
        if (refusal := unauthorized(scheduler, request)) is not None:
            return refusal
        return JSONResponse({"is_sleeping": sleep_of(scheduler).asleep or scheduler.service.core.paused})

    return router

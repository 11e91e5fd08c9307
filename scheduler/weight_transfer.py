"""vLLM's weight-transfer routes and ``/reset_prefix_cache`` on the scheduler's HTTP port,
fanned out to every worker (docs/INTEGRATIONS.md, "Weight transfer (NCCL)").

``POST /init_weight_transfer_engine {init_info}``, ``/start_weight_update``,
``/update_weights {update_info}`` (the ``/update_weights`` route of ``rl_api`` calls
``update_weights`` here when the body has ``update_info``) and ``/finish_weight_update
{weight_version}`` answer as vLLM's (``{"message": ...}``) once every worker of the group did
the same; each worker gets the trainer's ``init_info`` with its own ``rank_offset``
(``core/transfer.py``). ``POST /reset_prefix_cache`` answers ``{"success": bool}``: true when
every worker reset its cache. A refused call changes nothing and names the field; a call that
failed, or got no answer, on some worker names each such worker and its error (HTTP 500), in
the OpenAI error shape. Off unless ``SchedulerSettings.weight_transfer_backend`` is set
(``/reset_prefix_cache`` is always on). Calls run one at a time.
"""

from __future__ import annotations

import logging
import weakref
from asyncio import Lock
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.scheduler.control import ControlAnswer
from bubblespec.scheduler.core.types import ErrorCode, InvalidRequest
from bubblespec.scheduler.openai_api import STATUS, read_json, unauthorized
from bubblespec.scheduler.openai_api import error as openai_error

if TYPE_CHECKING:
    from bubblespec.scheduler.app import SchedulerApp

__all__ = ["create_router", "update_weights"]

logger = logging.getLogger(__name__)
MAX_LABEL_CHARS = 200
"""Longest ``weight_version`` label accepted."""
_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # service -> the lock its calls take


class WorkersFailed(InvalidRequest):
    """A fanned-out call failed (or got no answer) on some workers: HTTP 500 naming each."""

    def __init__(self, call: str, answers: dict[str, ControlAnswer]):
        failed = {wid: a.error for wid, a in sorted(answers.items()) if not a.ok}
        reasons = "; ".join(f"worker {wid}: {why}" for wid, why in failed.items())
        super().__init__("workers", f"{call} failed on {len(failed)} of {len(answers)} worker(s): {reasons}", ErrorCode.INTERNAL)


def error(exc: InvalidRequest) -> JSONResponse:
    """An OpenAI-shaped error naming the field; a call in the wrong state is a conflict (409)."""
    status = 409 if exc.code == ErrorCode.FAILED_PRECONDITION else STATUS.get(exc.code, 400)
    return openai_error(status, str(exc), exc.field)


def _lock(scheduler: SchedulerApp) -> Lock:
    return _locks.setdefault(scheduler.service, Lock())


def _enabled(scheduler: SchedulerApp) -> None:
    if not scheduler.settings.weight_transfer_backend:
        raise InvalidRequest("weight_transfer_config", "the scheduler has no weight-transfer engine: start it with "
                             "--weight-transfer-backend nccl (SchedulerSettings.weight_transfer_backend, env "
                             "BUBBLESPEC_WEIGHT_TRANSFER_BACKEND) and its workers with the same backend")


async def _fan_out(scheduler: SchedulerApp, call: str, op: int, args: dict[str, dict],
                   policy_version: int = 0) -> dict[str, ControlAnswer]:
    service = scheduler.service
    answers = await service.control.fan_out(op, args, scheduler.settings.weight_transfer_timeout_seconds,
                                            policy_version)
    failed = [wid for wid, a in answers.items() if not a.ok]
    if failed:
        logger.error("%s failed on worker(s) %s", call, ", ".join(sorted(failed)))
    return answers


def _errors(answers: dict[str, ControlAnswer]) -> dict[str, str | None]:
    return {wid: a.error for wid, a in answers.items()}


# ------------------------------------------------------------------- calls --

async def _init(scheduler: SchedulerApp, body: dict) -> dict:
    _enabled(scheduler)
    transfer = scheduler.service.transfer
    plan = transfer.plan_init(body.get("init_info"))
    args = {wid: {"init_info": info} for wid, info in plan.items()}
    answers = await _fan_out(scheduler, "init_weight_transfer_engine", pb.CONTROL_OP_INIT_WEIGHT_TRANSFER, args)
    if not all(a.ok for a in answers.values()):
        transfer.reset()  # the group is broken: the trainer inits again
        raise WorkersFailed("init_weight_transfer_engine", answers)
    transfer.commit_init(plan)
    logger.info("weight transfer: %d worker(s) joined the trainer's group (%s)", len(plan),
                ", ".join(f"{wid}@{info['rank_offset']}" for wid, info in plan.items()))
    return {"message": "Weight transfer initialized"}


async def _start(scheduler: SchedulerApp, body: dict) -> dict:
    _enabled(scheduler)
    service = scheduler.service
    version, actions = service.transfer.start()
    service.execute(actions)
    args = {wid: {} for wid in service.transfer.members}
    answers = await _fan_out(scheduler, "start_weight_update", pb.CONTROL_OP_START_WEIGHT_UPDATE, args)
    if not all(a.ok for a in answers.values()):
        service.execute(service.transfer.abort(_errors(answers)))
        raise WorkersFailed("start_weight_update", answers)
    logger.info("weight transfer: update to policy version %d started", version)
    return {"message": "Weight update started"}


def _checked_group(scheduler: SchedulerApp) -> None:
    """The group is still the one of init, else the update in progress fails (and the error
    is raised): a worker that left or joined has not got the weights."""
    service = scheduler.service
    try:
        service.transfer.check_members()
    except InvalidRequest as exc:
        service.execute(service.transfer.abort({}, str(exc)))
        raise


async def _update(scheduler: SchedulerApp, body: dict) -> dict:
    _enabled(scheduler)
    transfer = scheduler.service.transfer
    transfer.check_updating("update")
    plan = transfer.plan_update(body.get("update_info"))
    _checked_group(scheduler)
    args = {wid: {"update_info": info} for wid, info in plan.items()}
    answers = await _fan_out(scheduler, "update_weights", pb.CONTROL_OP_UPDATE_WEIGHTS, args)
    if not all(a.ok for a in answers.values()):
        scheduler.service.execute(transfer.abort(_errors(answers)))
        raise WorkersFailed("update_weights", answers)
    return {"message": "Weights updated"}


async def _finish(scheduler: SchedulerApp, body: dict) -> dict:
    _enabled(scheduler)
    service = scheduler.service
    label = body.get("weight_version")
    if label is not None and (not isinstance(label, str) or not 0 < len(label) <= MAX_LABEL_CHARS):
        raise InvalidRequest("weight_version", f"must be null or a string of 1 to {MAX_LABEL_CHARS} characters")
    version = service.transfer.check_updating("finish")
    _checked_group(scheduler)
    args = {wid: {"weight_version": label} for wid in service.transfer.members}
    answers = await _fan_out(scheduler, "finish_weight_update", pb.CONTROL_OP_FINISH_WEIGHT_UPDATE, args, version)
    service.execute(service.transfer.finish(label or "", _errors(answers)))
    if not all(a.ok for a in answers.values()):
        raise WorkersFailed("finish_weight_update", answers)
    logger.info("weight transfer: policy version %d (%s) is current", version, service.core.policy_weights_path)
    return {"message": "Weight update finished"}


async def _reset_prefix_cache(scheduler: SchedulerApp, flags: dict) -> dict:
    args = {wid: flags for wid in scheduler.service.links}
    answers = await _fan_out(scheduler, "reset_prefix_cache", pb.CONTROL_OP_RESET_PREFIX_CACHE, args)
    if not all(a.ok for a in answers.values()):
        raise WorkersFailed("reset_prefix_cache", answers)
    return {"success": all(a.result.get("success") is True for a in answers.values())}


async def update_weights(scheduler: SchedulerApp, body: dict) -> Response:
    """vLLM's ``POST /update_weights {update_info}``: one chunk of trainer-pushed weights,
    received by every worker of the group. ``body``: the parsed request (authorized)."""
    return await _answer(scheduler, _update, body)


async def _answer(scheduler: SchedulerApp, call, body: dict) -> Response:
    try:
        async with _lock(scheduler):
            return JSONResponse(await call(scheduler, body))
    except InvalidRequest as exc:
        return error(exc)


# ------------------------------------------------------------------ routes --

def create_router(scheduler: SchedulerApp) -> APIRouter:
    router = APIRouter()

    async def handle(request: Request, call) -> Response:
        if (refusal := unauthorized(scheduler, request)) is not None:
            return refusal
        try:
            body = await read_json(request, scheduler.settings.limits.max_request_bytes, empty={})
        except InvalidRequest as exc:
            return error(exc)
        return await _answer(scheduler, call, body)

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> Response:
        return await handle(request, _init)

    @router.post("/start_weight_update")
    async def start_weight_update(request: Request) -> Response:
        return await handle(request, _start)

    @router.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> Response:
        return await handle(request, _finish)

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request, reset_running_requests: bool = False,
                                 reset_external: bool = False) -> Response:
        flags = {"reset_running_requests": reset_running_requests, "reset_external": reset_external}
        return await handle(request, lambda s, _body: _reset_prefix_cache(s, flags))

    return router

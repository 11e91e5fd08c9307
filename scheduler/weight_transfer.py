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

``POST /collective_rpc {method, kwargs}`` serves the methods SkyRL's weight sync calls
(``skyrl_start_weight_update``, ``update_weights_nccl``, ``skyrl_finish_weight_update``: the
same three steps as the routes above, fanned out the same way) and refuses every other method
by name. ``POST /abort_weight_update`` rolls back the update in progress at once; one not
finished within ``SchedulerSettings.weight_update_deadline_seconds`` is rolled back the same
way (``core/transfer.py``). Either way each member that took ``start`` is told to close the
update in its engine (``CONTROL_OP_ABORT_WEIGHT_UPDATE``); a member that could not is closed
again before the next ``start``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from asyncio import Lock
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
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

__all__ = ["COLLECTIVE_RPC_METHODS", "WorkersFailed", "calls_lock", "create_router", "error", "fan_out", "update_weights"]

logger = logging.getLogger(__name__)
MAX_LABEL_CHARS = 200
"""Longest ``weight_version`` label accepted."""
_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # service -> the lock its calls take
_watches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # service -> its deadline watch task
COLLECTIVE_RPC_METHODS = {"skyrl_start_weight_update": ("is_checkpoint_format",), "update_weights_nccl": ("update_info",),
                          "skyrl_finish_weight_update": ()}
"""The ``/collective_rpc`` methods served (SkyRL's weight sync, ``RemoteInferenceClient``) and their kwargs."""
_timeout: ContextVar[float | None] = ContextVar("collective_rpc_timeout", default=None)  # /collective_rpc's timeout


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


calls_lock = _lock
"""The lock the fanned-out control calls take: one at a time (``sleep_api`` takes it too)."""


def _enabled(scheduler: SchedulerApp) -> None:
    if not scheduler.settings.weight_transfer_backend:
        raise InvalidRequest("weight_transfer_config", "the scheduler has no weight-transfer engine: start it with "
                             "--weight-transfer-backend nccl (SchedulerSettings.weight_transfer_backend, env "
                             "BUBBLESPEC_WEIGHT_TRANSFER_BACKEND) and its workers with the same backend")


async def _fan_out(scheduler: SchedulerApp, call: str, op: pb.ControlOp, args: dict[str, dict],
                   policy_version: int = 0) -> dict[str, ControlAnswer]:
    service = scheduler.service
    timeout = _timeout.get() or scheduler.settings.weight_transfer_timeout_seconds
    answers = await service.control.fan_out(op, args, timeout, policy_version)
    failed = [wid for wid, a in answers.items() if not a.ok]
    if failed:
        logger.error("%s failed on worker(s) %s", call, ", ".join(sorted(failed)))
    return answers


fan_out = _fan_out
"""``fan_out(scheduler, call, op, args)``: a control call to each worker of ``args``; every answer."""


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
    service.transfer.check_members()
    answers = await _close_open(scheduler)  # an update rolled back earlier that a worker could not close yet
    if not all(a.ok for a in answers.values()):
        raise WorkersFailed("abort_weight_update (closing the update rolled back before)", answers)
    version, actions = service.transfer.start()
    service.execute(actions)
    args: dict[str, dict] = {wid: {} for wid in service.transfer.members}
    answers = await _fan_out(scheduler, "start_weight_update", pb.CONTROL_OP_START_WEIGHT_UPDATE, args)
    service.transfer.started(_errors(answers))
    if not all(a.ok for a in answers.values()):
        service.execute(service.transfer.abort(_errors(answers)))
        await _close_open(scheduler)
        raise WorkersFailed("start_weight_update", answers)
    _watch(scheduler)
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
        await _close_open(scheduler)
        raise WorkersFailed("finish_weight_update", answers)
    logger.info("weight transfer: policy version %d (%s) is current", version, service.core.policy_weights_path)
    return {"message": "Weight update finished"}


async def _collective_rpc(scheduler: SchedulerApp, body: dict) -> dict:
    """vLLM's ``/collective_rpc``, for the methods of ``COLLECTIVE_RPC_METHODS`` only: each is
    one step of the weight-transfer protocol, fanned out to every member. vLLM's answer: one
    result per worker rank (these methods return none)."""
    method = body.get("method")
    if method not in COLLECTIVE_RPC_METHODS:
        served = ", ".join(COLLECTIVE_RPC_METHODS)
        raise InvalidRequest("method", f"{method!r:.60} is not served by BubbleSpec: /collective_rpc runs only the "
                             f"weight-sync methods of SkyRL's RemoteInferenceClient ({served}), each fanned out to "
                             "every worker; arbitrary worker methods are not run")
    for name in body:
        if name not in ("method", "args", "kwargs", "timeout"):
            raise InvalidRequest(name, f"{name} is not a field of /collective_rpc (method, args, kwargs, timeout)")
    if body.get("args"):
        raise InvalidRequest("args", f"{method} takes its arguments as kwargs, got positional args")
    kwargs = body.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest("kwargs", f"must be a JSON object, got {kwargs!r:.40}")
    for name in kwargs:
        if name not in COLLECTIVE_RPC_METHODS[method]:
            raise InvalidRequest(f"kwargs.{name}", f"{method} takes no argument {name!r:.40} (it takes: "
                                 f"{', '.join(COLLECTIVE_RPC_METHODS[method]) or 'none'})")
    timeout = body.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or not math.isfinite(timeout) or timeout <= 0):
        raise InvalidRequest("timeout", f"must be null or a number of seconds > 0, got {timeout!r:.40}")
    token = _timeout.set(float(timeout) if timeout is not None else None)
    try:
        if method == "skyrl_start_weight_update":
            fmt = kwargs.get("is_checkpoint_format", True)
            if fmt is not True:
                raise InvalidRequest("kwargs.is_checkpoint_format", "only true is served: vLLM's weight-transfer "
                                     "engines take checkpoint-format weights (a layerwise reload); kernel-format "
                                     f"weights copied in place are not, got {fmt!r:.20}")
            await _start(scheduler, {})
        elif method == "update_weights_nccl":
            await _update(scheduler, {"update_info": kwargs.get("update_info")})
        else:
            await _finish(scheduler, {})
    finally:
        _timeout.reset(token)
    ranks = sum(m.tensor_parallel_size for m in scheduler.service.transfer.members.values())
    return {"results": [None] * ranks}


async def _abort(scheduler: SchedulerApp, body: dict) -> dict:
    """Roll back the update in progress (none in progress: refused, unless a rolled-back update
    is still open on some worker, which is then closed)."""
    _enabled(scheduler)
    if body:
        raise InvalidRequest(next(iter(body)), "POST /abort_weight_update takes no fields")
    transfer = scheduler.service.transfer
    version = transfer.updating
    if version is None and not transfer.unclosed:
        raise InvalidRequest("request", "no weight update is in progress", ErrorCode.FAILED_PRECONDITION)
    if version is not None:
        scheduler.service.execute(transfer.abort({}, f"the weight update to version {version} was aborted "
                                                     f"(POST /abort_weight_update); the cluster stays at version "
                                                     f"{scheduler.service.core.policy_version}"))
        logger.warning("weight transfer: update to policy version %d aborted", version)
    answers = await _close_open(scheduler)
    if not all(a.ok for a in answers.values()):
        raise WorkersFailed("abort_weight_update (the update is rolled back; closing it in the engine)", answers)
    return {"message": "Weight update aborted"}


async def _close_open(scheduler: SchedulerApp) -> dict[str, ControlAnswer]:
    """Tell each member still holding a rolled-back update open to close it; those that did
    leave ``transfer.unclosed``, a worker that left is dropped from it (its engine is gone)."""
    transfer = scheduler.service.transfer
    transfer.unclosed &= set(scheduler.service.links)
    if not transfer.unclosed or transfer.updating is not None:
        return {}
    args: dict[str, dict] = {wid: {} for wid in sorted(transfer.unclosed)}
    answers = await _fan_out(scheduler, "abort_weight_update", pb.CONTROL_OP_ABORT_WEIGHT_UPDATE, args)
    transfer.unclosed -= {wid for wid, a in answers.items() if a.ok}
    return answers


def _watch(scheduler: SchedulerApp) -> None:
    """Roll back the update just started if it outlives its deadline (``core/transfer.py``: the
    core's clock decides); a check every second at most, ends with the update."""
    service = scheduler.service
    transfer, started = service.transfer, service.transfer.started_at
    period = max(0.05, min(1.0, transfer.deadline_seconds / 20))

    async def watch() -> None:
        while transfer.updating is not None and transfer.started_at == started:
            if transfer.overdue() is None:
                await asyncio.sleep(period)
                continue
            version = transfer.updating
            service.execute(transfer.expire())
            logger.error("weight transfer: the update to policy version %d was not finished within %gs and was "
                         "rolled back", version, transfer.deadline_seconds)
            answers = await _close_open(scheduler)
            if not all(a.ok for a in answers.values()):
                logger.error("%s", WorkersFailed("abort_weight_update", answers))
            return

    old = _watches.get(service)
    if old is not None:
        old.cancel()
    _watches[service] = asyncio.get_running_loop().create_task(watch())


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


_Call = Callable[["SchedulerApp", dict], Awaitable[dict]]
"""A weight-transfer call: the scheduler and the request's JSON body to the JSON answer."""


async def _answer(scheduler: SchedulerApp, call: _Call, body: dict) -> Response:
    try:
        async with _lock(scheduler):
            return JSONResponse(await call(scheduler, body))
    except InvalidRequest as exc:
        return error(exc)


# ------------------------------------------------------------------ routes --

def create_router(scheduler: SchedulerApp) -> APIRouter:
    router = APIRouter()
    scheduler.service.transfer.deadline_seconds = scheduler.settings.weight_update_deadline_seconds

    async def handle(request: Request, call: _Call) -> Response:
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

    @router.post("/collective_rpc")
    async def collective_rpc(request: Request) -> Response:
        return await handle(request, _collective_rpc)

    @router.post("/abort_weight_update")
    async def abort_weight_update(request: Request) -> Response:
        if (refusal := unauthorized(scheduler, request)) is not None:
            return refusal
        try:  # not behind the calls' lock: a call stuck on a dead trainer holds it
            body = await read_json(request, scheduler.settings.limits.max_request_bytes, empty={})
            return JSONResponse(await _abort(scheduler, body))
        except InvalidRequest as exc:
            return error(exc)

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request, reset_running_requests: bool = False,
                                 reset_external: bool = False) -> Response:
        flags = {"reset_running_requests": reset_running_requests, "reset_external": reset_external}
        return await handle(request, lambda s, _body: _reset_prefix_cache(s, flags))

    return router

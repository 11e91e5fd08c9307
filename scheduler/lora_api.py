"""vLLM's LoRA routes on the scheduler's HTTP port, fanned out to every worker (docs/INTEGRATIONS.md,
"LoRA adapters"; names, versions and holders: ``core/adapters.py``).

- ``POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}`` loads the adapter on every
  connected worker (``CONTROL_OP_LOAD_LORA_ADAPTER``) and answers as vLLM does: 200 with the
  text ``Success: LoRA adapter '<name>' added successfully.``; vLLM's refusals (400: a field
  missing, the base model's name, a loaded name without ``load_inplace``). Each load is a policy
  update of that adapter: version 1 at its first load, +1 at each reload; while it loads, new
  requests naming it wait (the base model's and other adapters' go on). A load that failed on
  any worker is undone on the others, and the answer names each worker that failed and says
  the new version is served nowhere (404 naming ``lora_path`` where every worker found no
  adapter at the path, as vLLM's ``LoRAAdapterNotFoundError``; else 500): the adapter stays as
  it was.
- ``POST /v1/unload_lora_adapter {lora_name}``: 200 ``Success: LoRA adapter '<name>' removed
  successfully.``; 404 for a name not loaded. Queued requests naming it fail; running ones finish.
- A worker that connects after a load loads the current version of every adapter
  (``load_on_join``, under each adapter's lock, so never beside a load or unload of it), and
  takes that adapter's requests only once it holds it. A load that fails there is logged as an
  error naming the worker, the adapter and the reason; that worker serves none of the adapter's
  requests, and a request that no worker can serve is refused (503) naming it.
- ``/v1/models`` lists each adapter as vLLM does (``parent``: the base model, ``root``: its path);
  a completion, chat or generate call whose ``model`` names an adapter runs with its current
  version, and the answer carries that version in the ``X-BubbleSpec-Adapter-Version`` header
  (``Completion.adapter_version`` on the gRPC side; ``policy_version`` stays the base model's).

Unlike ``vllm serve``, the routes need no ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: runtime loads are
what a trainer's PEFT run does (without the variable vLLM does not register them: 404). Workers
started without ``--enable-lora`` fail a load, named. ``is_3d_lora_weight`` is refused by name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request, Response

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.scheduler.control import ControlAnswer
from bubblespec.scheduler.core.types import ErrorCode, InvalidRequest
from bubblespec.scheduler.lora_models import loads_of
from bubblespec.scheduler.openai_api import STATUS, read_json, unauthorized
from bubblespec.scheduler.openai_api import error as openai_error

if TYPE_CHECKING:
    from bubblespec.scheduler.app import SchedulerApp
    from bubblespec.scheduler.service import WorkerLink

__all__ = ["create_router", "load_adapter", "load_on_join"]

logger = logging.getLogger(__name__)
_FIELDS = ("lora_name", "lora_path", "load_inplace", "is_3d_lora_weight")


def _failed(call: str, name: str, version: int, answers: dict[str, ControlAnswer]) -> InvalidRequest:
    failed = {wid: a.error for wid, a in sorted(answers.items()) if not a.ok}
    reasons = "; ".join(f"worker {wid}: {why}" for wid, why in failed.items())
    message = (f"{call} of adapter '{name}' failed on {len(failed)} of {len(answers)} worker(s): {reasons}. "
               f"Its version {version} is served on no worker")
    if all((why or "").startswith("lora_path:") or "No adapter found" in (why or "") for why in failed.values()):
        return InvalidRequest("lora_path", message, ErrorCode.NOT_FOUND)
    return InvalidRequest("workers", message, ErrorCode.INTERNAL)


async def load_adapter(scheduler: SchedulerApp, body: dict) -> str:
    """``/v1/load_lora_adapter``'s work on ``body`` (its fields checked here): vLLM's success text,
    or ``InvalidRequest`` naming the field or the workers, with the adapter as it was."""
    for key in body:
        if key not in _FIELDS:
            raise InvalidRequest(key, f"{key} is not a field of vLLM 0.32's /v1/load_lora_adapter "
                                 f"({', '.join(_FIELDS)})")
    if body.get("is_3d_lora_weight"):
        raise InvalidRequest("is_3d_lora_weight", "3D (MoE) LoRA weights are not served")
    inplace = body.get("load_inplace", False)
    if not isinstance(inplace, bool):
        raise InvalidRequest("load_inplace", f"must be a boolean, got {inplace!r:.40}")
    service = scheduler.service
    table = service.core.adapters
    state = loads_of(table)
    name = body.get("lora_name")
    lock = state.locks.setdefault(name if isinstance(name, str) else "", asyncio.Lock())
    async with lock:
        if isinstance(name, str) and name and scheduler.settings.serves_model(name):  # any name the base is served by
            raise InvalidRequest("lora_name", f"The lora adapter '{name}' conflicts with a served base model.")
        plan = table.begin_load(name, body.get("lora_path"), scheduler.settings.model_name(), inplace)
        done = state.done[plan.name] = asyncio.Event()  # the adapter's new requests wait on it
        try:
            workers = sorted(service.links)
            if not workers:
                raise InvalidRequest("workers", "no worker is connected", ErrorCode.UNAVAILABLE)
            args = {wid: {"lora_name": plan.name, "lora_path": plan.path, "version": plan.version,
                          "lora_int_id": plan.int_id} for wid in workers}
            timeout = scheduler.settings.weight_transfer_timeout_seconds
            answers = await service.control.fan_out(pb.CONTROL_OP_LOAD_LORA_ADAPTER, args, timeout)
            if not all(a.ok for a in answers.values()):
                took = {wid: {"lora_name": plan.name, "version": plan.version} for wid, a in answers.items() if a.ok}
                if took:  # undo: the new version is served nowhere
                    undone = await service.control.fan_out(pb.CONTROL_OP_UNLOAD_LORA_ADAPTER, took, timeout)
                    for wid, a in undone.items():
                        if not a.ok:
                            logger.error("worker %s: could not drop adapter %r version %d after a failed load: %s",
                                         wid, plan.name, plan.version, a.error)
                raise _failed("load_lora_adapter", plan.name, plan.version, answers)
            table.finish_load(plan, set(answers))
        except BaseException:
            table.abandon_load(plan)
            raise
        finally:
            state.done.pop(plan.name, None)
            done.set()
    logger.info("loaded LoRA adapter %r version %d from %r on %d worker(s)", plan.name, plan.version, plan.path,
                len(workers))
    return f"Success: LoRA adapter '{plan.name}' added successfully."


async def _unload(scheduler: SchedulerApp, body: dict) -> str:
    for key in body:
        if key not in ("lora_name", "lora_int_id"):
            raise InvalidRequest(key, f"{key} is not a field of vLLM 0.32's /v1/unload_lora_adapter "
                                 "(lora_name, lora_int_id)")
    service = scheduler.service
    state = loads_of(service.core.adapters)
    name = body.get("lora_name")
    async with state.locks.setdefault(name if isinstance(name, str) else "", asyncio.Lock()):
        service.execute(service.core.unload_adapter(name))
        args = {wid: {"lora_name": name, "version": None} for wid in service.links}
        answers = await service.control.fan_out(pb.CONTROL_OP_UNLOAD_LORA_ADAPTER, args,
                                                scheduler.settings.weight_transfer_timeout_seconds)
    for wid, a in answers.items():  # it is served nowhere already: a worker that kept it only holds memory
        if not a.ok:
            logger.error("worker %s: could not drop adapter %r: %s", wid, name, a.error)
    return f"Success: LoRA adapter '{name}' removed successfully."


async def load_on_join(scheduler: SchedulerApp, link: WorkerLink) -> None:
    """The worker of ``link`` connected: load on it the current version of every adapter it
    does not hold, one by one under that adapter's lock; each one it loads, it serves from then
    on (its queued requests are handed out); one that fails it does not serve (logged, named
    in refusals: ``AdapterTable.join_failed``). Stops once that worker has left."""
    service = scheduler.service
    table = service.core.adapters
    state = loads_of(table)
    wid = link.worker_id
    for name in sorted({*table.served, *table.loading}):  # a load in progress: its outcome, once it ends
        async with state.locks.setdefault(name, asyncio.Lock()):
            plan = table.missing(wid, name)
            if plan is None or service.links.get(wid) is not link:
                continue
            args = {wid: {"lora_name": plan.name, "lora_path": plan.path, "version": plan.version,
                          "lora_int_id": plan.int_id}}
            answer = (await service.control.fan_out(pb.CONTROL_OP_LOAD_LORA_ADAPTER, args,
                                                    scheduler.settings.weight_transfer_timeout_seconds))[wid]
            if service.links.get(wid) is not link:  # it left meanwhile: a worker that comes back starts afresh
                return
            if not answer.ok:
                table.join_failed(wid, plan, answer.error or "")
                logger.error("worker %s could not load LoRA adapter %r version %d from %r when it connected: %s; it "
                             "serves none of that adapter's requests", wid, plan.name, plan.version, plan.path,
                             answer.error)
            elif table.joined(wid, plan):
                logger.info("worker %s loaded LoRA adapter %r version %d when it connected", wid, plan.name,
                            plan.version)
                service.execute(service.core.dispatch())  # the adapter's queued requests may go to it now


def create_router(scheduler: SchedulerApp) -> APIRouter:
    router = APIRouter()
    joins: set[asyncio.Task] = set()

    def joined(link: WorkerLink) -> None:
        if scheduler.service.core.adapters.served or scheduler.service.core.adapters.loading:
            task = asyncio.get_running_loop().create_task(load_on_join(scheduler, link))
            joins.add(task)
            task.add_done_callback(joins.discard)

    scheduler.service.on_join.append(joined)

    async def answer(request: Request, call: Callable[[SchedulerApp, dict], Awaitable[str]]) -> Response:
        if (refusal := unauthorized(scheduler, request)) is not None:
            return refusal
        try:
            body = await read_json(request, scheduler.settings.limits.max_request_bytes)
            return Response(status_code=200, content=await call(scheduler, body))
        except InvalidRequest as exc:
            return openai_error(STATUS.get(exc.code, 400), str(exc), exc.field)

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await answer(request, load_adapter)

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await answer(request, _unload)

    return router

"""prime-rl's own inference-server routes on the scheduler's HTTP port (docs/INTEGRATIONS.md,
"prime-rl"). prime-rl's ``uv run inference`` adds them to vLLM's server; plain vLLM has neither.

- ``GET /liveness`` -> ``{"status": "ok"}``: prime-rl's Kubernetes liveness probe, which there
  asks the engine for a no-op RPC and answers 503 ``{"status": "engine_unresponsive"}`` when it
  times out. Here the scheduler's event loop answers it: a wedged scheduler fails the probe by
  not answering. Workers are not asked: a worker that stops answering is dropped by the
  scheduler's keepalive and its work moves to the others, so restarting the scheduler would not
  help. Open, as ``/health`` and ``/healthz`` (probes send no token).
- ``POST /init_broadcaster``: prime-rl's NCCL (and NIXL) weight broadcast, in which the trainer
  is rank 0 of a group with every inference GPU and streams its own packing of the state dict
  into prime-rl's vLLM worker extension. BubbleSpec's workers do not run that extension, and
  vLLM's weight-transfer routes (``weight_transfer.py``) take a different packing, so the
  route is refused: 404 in OpenAI's error shape naming the route and what to use instead
  (``POST /update_weights {"weight_dir": ...}``, or vLLM's weight-transfer routes), and the
  scheduler logs a warning. 404 because prime-rl's NCCL set-up reports only a 404 (it logs that
  the route does not exist and goes on without NCCL); other statuses it drops without a word.
  Changes nothing.
- ``POST /load_lora_adapter {lora_name, lora_path}`` -> ``{"status": "ok"}``: prime-rl's wrapper of
  vLLM's ``/v1/load_lora_adapter``, which its orchestrator calls after every step of a LoRA run
  with the same name and a new path. As prime-rl's, it always loads in place (``load_inplace`` is
  forced true), so each call is the adapter's next version (``lora_api.py``: barrier, version
  stamp, drafts keyed by version). Failures answer as that route does (400/404/500 in OpenAI's
  error shape, naming the field or the workers), and change nothing; prime-rl retries 404 and 500.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from bubblespec.scheduler.core.types import InvalidRequest
from bubblespec.scheduler.lora_api import load_adapter
from bubblespec.scheduler.openai_api import STATUS, error, read_json, unauthorized

if TYPE_CHECKING:
    from bubblespec.scheduler.app import SchedulerApp

__all__ = ["INIT_BROADCASTER_REFUSAL", "create_router"]

logger = logging.getLogger(__name__)

INIT_BROADCASTER_REFUSAL = (
    "POST /init_broadcaster (prime-rl's NCCL/NIXL weight broadcast) is not served by BubbleSpec: its workers "
    "do not run prime-rl's vLLM worker extension. Use the filesystem weight broadcast (POST /update_weights "
    "{\"weight_dir\": ...} between /pause and /resume) or vLLM's weight-transfer routes (docs/INTEGRATIONS.md)")


def create_router(scheduler: SchedulerApp) -> APIRouter:
    router = APIRouter()

    @router.get("/liveness")
    async def liveness() -> Response:
        return JSONResponse({"status": "ok"})

    @router.post("/init_broadcaster")
    async def init_broadcaster(request: Request) -> Response:
        if (refusal := unauthorized(scheduler, request)) is not None:
            return refusal
        logger.warning("refused POST /init_broadcaster: prime-rl's NCCL weight broadcast is not served")
        return error(404, INIT_BROADCASTER_REFUSAL, "init_broadcaster")

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        if (refusal := unauthorized(scheduler, request)) is not None:
            return refusal
        try:
            body = await read_json(request, scheduler.settings.limits.max_request_bytes)
            await load_adapter(scheduler, {**body, "load_inplace": True})
        except InvalidRequest as exc:
            return error(STATUS.get(exc.code, 400), str(exc), exc.field)
        return JSONResponse({"status": "ok"})

    return router

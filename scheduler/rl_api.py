"""vLLM-compatible RL control routes on the scheduler's HTTP port (docs/INTEGRATIONS.md).

- ``GET /get_world_size`` -> ``{"world_size": N}``: the inference ranks behind the scheduler,
  the sum over live workers of their tensor-parallel size (``include_dp`` is accepted; the
  whole cluster is one data-parallel group, so both answers are the same).
- ``POST /pause?mode=abort|wait|keep`` -> ``{"status": "paused"}``, ``POST /resume`` ->
  ``{"status": "resumed"}``, ``GET /is_paused`` -> ``{"is_paused": bool}``: the scheduler's
  dispatch, with BubbleSpec's guarantees (``core/pause.py``). ``clear_cache`` is accepted and
  ignored (vLLM ignores it for ``keep``; a policy update resets what depends on the weights).
  ``/resume`` is refused (409) while the engines sleep (``sleep_api``: ``/wake_up`` resumes).
- ``POST /update_weights {"weight_dir": DIR}`` (prime-rl): the policy-version barrier, version
  = current + 1; the answer comes once every worker loaded it. ``{"update_info": {...}}`` is
  vLLM's weight-transfer form, always handed to ``bubblespec.scheduler.weight_transfer``, which
  serves it only on a scheduler started with a weight-transfer backend
  (``SchedulerSettings.weight_transfer_backend``, ``--weight-transfer-backend nccl``) and
  otherwise refuses it with 400 naming ``weight_transfer_config``. ``POST /reload_weights``
  (older prime-rl): back to the weights the workers started from, as a new version.
- ``GET /server_info?config_format=json`` -> ``{"vllm_config": {...}}`` with what trainers read
  (TRL: ``model_config.logprobs_mode`` and ``model_config.dtype``, ``weight_transfer_config``,
  ``parallel_config``, ``lora_config``: vLLM's dump of the workers' LoRA config where every
  worker runs with ``--enable-lora``, its capacities the smallest of theirs; else null).

Every route takes the trainer token when the scheduler has one (401 otherwise); every refusal
is an OpenAI error ``{"error": {message, type, param, code}}`` naming the field, and changes
nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from bubblespec.scheduler import weight_transfer
from bubblespec.scheduler.core.pause import PAUSE_MODES
from bubblespec.scheduler.core.types import ErrorCode, InvalidRequest
from bubblespec.scheduler.core.validate import Limits, check_weights_path
from bubblespec.scheduler.lora_models import cluster_lora_config
from bubblespec.scheduler.openai_api import _refusal, error, read_json, unauthorized

if TYPE_CHECKING:
    from bubblespec.scheduler.app import SchedulerApp

__all__ = ["create_router", "server_config", "world_size"]

_RENAME = {"weights_path": "weight_dir"}
"""``_refusal`` names the route's own field: a policy update's ``weights_path`` is ``weight_dir``."""
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def world_size(scheduler: SchedulerApp) -> int:
    """Inference ranks behind the scheduler: the sum of the live workers' tensor-parallel sizes."""
    return sum(max(1, w.tensor_parallel_size) for w in scheduler.service.core.stats().workers)


def _dtype(scheduler: SchedulerApp) -> str | None:
    """vLLM's ``model_config.dtype`` as its JSON dump writes it (``torch.bfloat16``): the dtype
    the live workers' engines run the model in; None where no worker said, or they differ."""
    dtypes = {w.dtype for w in scheduler.service.core.stats().workers}
    return f"torch.{dtypes.pop()}" if len(dtypes) == 1 and "" not in dtypes else None


def server_config(scheduler: SchedulerApp) -> dict:
    """The part of vLLM's ``VllmConfig`` JSON that trainers read."""
    s = scheduler.settings
    limits = scheduler.service.core.model_limits
    ranks = world_size(scheduler)
    backend = s.weight_transfer_backend  # the weight-transfer fan-out (weight_transfer.py): None = off
    return {
        "model_config": {
            "model": s.model_name(), "served_model_name": s.model_name(), "tokenizer": s.tokenizer or None,
            "max_model_len": None if limits is None else limits.max_model_len,
            "logprobs_mode": "processed_logprobs" if s.default_logprobs_mode == "processed" else "raw_logprobs",
            "dtype": _dtype(scheduler), "max_logprobs": s.limits.max_logprobs, "skip_tokenizer_init": False,
        },
        "parallel_config": {"world_size": ranks, "world_size_across_dp": ranks, "tensor_parallel_size": ranks,
                            "pipeline_parallel_size": 1, "data_parallel_size": 1},
        "weight_transfer_config": {"backend": backend} if backend else None,
        # vLLM's own dump of the workers' LoRA config where every worker runs with --enable-lora (TRL's async
        # trainers then sync adapters: /v1/load_lora_adapter), else None (they sync whole weights)
        "lora_config": cluster_lora_config(link.lora_config for _, link in sorted(scheduler.service.links.items())),
    }


def _flag(request: Request, name: str, default: bool) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise InvalidRequest(name, f"must be true or false, got {raw!r:.40}")


def _weight_dir(body: dict, limits: Limits) -> str:
    path = body.get("weight_dir")
    if not isinstance(path, str) or not path:
        raise InvalidRequest("weight_dir", f"must be a non-empty string (a checkpoint directory every worker can "
                             f"read), got {path!r:.60}")
    check_weights_path(path, limits)
    return path


def _base_weights(scheduler: SchedulerApp) -> str:
    """The weights the live workers started from (their hello's ``model``), if they agree and
    the path is within ``Limits.max_weights_path_bytes``."""
    models = {w.model for w in scheduler.service.core.stats().workers}
    if not models:
        raise InvalidRequest("workers", "no live worker: the base weights are not known", ErrorCode.UNAVAILABLE)
    if "" in models:
        raise InvalidRequest("request", "a worker did not say which weights it started from: the base weights "
                             "are not known; use POST /update_weights {\"weight_dir\": ...}")
    if len(models) > 1:
        shown = ", ".join(sorted(repr(m[:120]) for m in models))
        raise InvalidRequest("request", f"the workers started from different weights ({shown}); use "
                             "POST /update_weights {\"weight_dir\": ...}")
    path = models.pop()
    try:
        check_weights_path(path, scheduler.settings.limits)
    except InvalidRequest as exc:  # a worker's own word, not the request's: name no request field
        raise InvalidRequest("request", f"the workers' base weights path {exc.message}") from None
    return path


async def _update(scheduler: SchedulerApp, path: str) -> dict:
    """The policy-version barrier to the next version (the core numbers it) from ``path``; the
    request names no version, so a refusal about it names the request."""
    ready = await scheduler.service.update_policy(None, path, field="request")
    return {"status": "ok", "policy_version": ready.version, "workers": ready.workers}


def create_router(scheduler: SchedulerApp) -> APIRouter:
    router = APIRouter()

    async def answer(request: Request, handler: Callable[[], Awaitable[dict | Response]]) -> Response:
        """Auth, then ``handler()`` (a dict, or a Response), refusals in OpenAI's error shape."""
        if (refusal := unauthorized(scheduler, request)) is not None:
            return refusal
        try:
            result = await handler()
        except InvalidRequest as exc:
            return _refusal(exc, _RENAME)
        return result if isinstance(result, Response) else JSONResponse(result)

    @router.get("/get_world_size")
    async def get_world_size(request: Request) -> Response:
        async def run() -> dict:
            _flag(request, "include_dp", True)
            return {"world_size": world_size(scheduler)}
        return await answer(request, run)

    @router.post("/pause")
    async def pause(request: Request) -> Response:
        async def run() -> dict | Response:
            mode = request.query_params.get("mode", "abort")
            if mode not in PAUSE_MODES:
                raise InvalidRequest("mode", f"must be one of {', '.join(PAUSE_MODES)}, got {mode!r:.40}")
            _flag(request, "clear_cache", True)
            if not await scheduler.service.pause(mode):
                return error(409, "mode: the scheduler was resumed (POST /resume) before the active steps ended",
                             "mode")
            return {"status": "paused"}
        return await answer(request, run)

    @router.post("/resume")
    async def resume(request: Request) -> Response:
        async def run() -> dict | Response:
            from bubblespec.scheduler.sleep_api import sleep_of

            if sleep_of(scheduler).asleep:
                return error(409, "request: the engines are asleep (POST /sleep): POST /wake_up resumes dispatch "
                             "once every worker is fully awake", "request")
            scheduler.service.resume()
            return {"status": "resumed"}
        return await answer(request, run)

    @router.get("/is_paused")
    async def is_paused(request: Request) -> Response:
        async def run() -> dict:
            return {"is_paused": scheduler.service.core.paused}
        return await answer(request, run)

    @router.post("/update_weights")
    async def update_weights(request: Request) -> Response:
        async def run() -> dict | Response:
            body = await read_json(request, scheduler.settings.limits.max_request_bytes)
            if "update_info" in body:
                if "weight_dir" in body:
                    raise InvalidRequest("weight_dir", "give either weight_dir (a checkpoint directory) or "
                                         "update_info (vLLM's weight transfer), not both")
                return await weight_transfer.update_weights(scheduler, body)  # vLLM's NCCL form
            return await _update(scheduler, _weight_dir(body, scheduler.settings.limits))
        return await answer(request, run)

    @router.post("/reload_weights")
    async def reload_weights(request: Request) -> Response:
        async def run() -> dict:
            return await _update(scheduler, _base_weights(scheduler))
        return await answer(request, run)

    @router.get("/server_info")
    async def server_info(request: Request) -> Response:
        async def run() -> dict:
            fmt = request.query_params.get("config_format", "text")
            if fmt not in ("text", "json"):
                raise InvalidRequest("config_format", f"must be text or json, got {fmt!r:.40}")
            config = server_config(scheduler)
            return {"vllm_config": config if fmt == "json" else str(config), "vllm_env": {}, "system_env": {}}
        return await answer(request, run)

    return router

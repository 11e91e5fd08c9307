"""The weights a worker's engine serves, and every change to them.

``Weights`` owns the policy version the engine has loaded (stamped on each completion by the
runner, sent in the hello and the metrics) and carries out the scheduler's commands that
change the weights or the engine's state around them: a policy load from a checkpoint
directory (``load_policy``; the checkpoint's check is ``worker/checkpoint.py``), and the
engine control calls (``control``): vLLM's weight transfer from a trainer, LoRA adapters
(``worker/lora.py``), prefix-cache reset, sleep and wake-up. No generation spans a change:
what still runs is dropped first (``Host.drain``). Weights in flux or lost are version -1,
and a worker serves nothing until a load or an update succeeds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Protocol

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.worker.checkpoint import CheckpointError
from bubblespec.worker.engine import Engine
from bubblespec.worker.link import Link

__all__ = ["CONTROL_OPS", "Host", "Weights"]

logger = logging.getLogger(__name__)

CONTROL_OPS = {pb.CONTROL_OP_INIT_WEIGHT_TRANSFER: "init_weight_transfer",  # -> Engine.control's op
               pb.CONTROL_OP_START_WEIGHT_UPDATE: "start_weight_update",
               pb.CONTROL_OP_UPDATE_WEIGHTS: "update_weights",
               pb.CONTROL_OP_FINISH_WEIGHT_UPDATE: "finish_weight_update",
               pb.CONTROL_OP_RESET_PREFIX_CACHE: "reset_prefix_cache", pb.CONTROL_OP_SLEEP: "sleep",
               pb.CONTROL_OP_WAKE_UP: "wake_up", pb.CONTROL_OP_ABORT_WEIGHT_UPDATE: "abort_weight_update",
               pb.CONTROL_OP_LOAD_LORA_ADAPTER: "load_lora_adapter",  # LoRA adapters: worker/lora.py
               pb.CONTROL_OP_UNLOAD_LORA_ADAPTER: "unload_lora_adapter"}
"""The scheduler's control operations, as ``Engine.control`` names them."""
_TRANSFERRED = "weight-transfer:"  # weights path of a version a trainer pushed by weight transfer: no directory


class Host(Protocol):
    """What the weights need of the worker they serve (``WorkerAgent``)."""

    def running(self) -> int:
        """Requests and draft jobs running now."""
        ...

    async def drain(self) -> None:
        """Drop whatever runs, and wait for stopped draft jobs to leave the engine."""
        ...

    def check_engine(self) -> None:
        """After a failure: leave the scheduler if the engine itself died."""
        ...


class Weights:
    """One worker's weights (module docstring). Owns ``version`` and the engine control calls,
    which run one at a time in the order they came."""

    def __init__(self, worker_id: str, engine: Engine, link: Link, host: Host, version: int):
        self.worker_id = worker_id
        self.engine = engine
        self.link = link
        self.host = host
        self.version = version
        """The policy version the engine serves (-1: unknown, the weights in flux or lost)."""
        self._controls: set[asyncio.Task] = set()  # engine control calls, run one at a time in arrival order
        self._control_lock = asyncio.Lock()

    async def stop(self) -> None:
        """Cancel the control calls still running or waiting, and wait for them to end."""
        for task in list(self._controls):
            task.cancel()
        await asyncio.gather(*self._controls, return_exceptions=True)

    async def load_policy(self, cmd: pb.LoadPolicy) -> None:
        """Load a policy in place. No generation spans a load: whatever still runs (none should:
        the scheduler stops draft jobs first and updates only between steps) is cancelled first.
        A checkpoint refused by its check leaves the old weights serving; any later failure
        leaves them unknown (version -1: this worker serves nothing until a load succeeds)."""
        started = time.monotonic()
        if cmd.weights_path.startswith(_TRANSFERRED):  # refused before anything changed
            error = (f"version {cmd.version} was pushed to the workers by weight transfer ({cmd.weights_path!r:.80}); "
                     "this worker was not in the trainer's group and cannot load it from a directory")
            logger.error("worker %s: %s", self.worker_id, error)
            self.link.send(policy_loaded=pb.PolicyLoaded(version=cmd.version, ok=False, error=error, seconds=0.0))
            return
        if running := self.host.running():
            logger.warning("worker %s: cancelling %d running task(s) before loading version %d",
                           self.worker_id, running, cmd.version)
        # and the draft jobs the scheduler stopped just before (``Runner.stop_draft`` does not wait
        # for their aborts): a request still in the engine holds KV blocks, and the load's prefix-cache
        # reset then fails (a CI run saw it, right after a bench's draft jobs were stopped)
        await self.host.drain()
        try:
            await self.engine.load_weights(cmd.weights_path)
        except CheckpointError as exc:  # refused before any weight changed: keep serving the old version
            logger.error("worker %s: version %d refused, still serving %d: %s", self.worker_id, cmd.version,
                         self.version, exc)
            self.link.send(policy_loaded=pb.PolicyLoaded(version=cmd.version, ok=False, error=str(exc)[:500],
                                                         seconds=time.monotonic() - started))
            return
        except Exception as exc:
            logger.exception("worker %s: loading %s failed; its weights are now unknown", self.worker_id, cmd.weights_path)
            self.version = -1
            self.link.send(policy_loaded=pb.PolicyLoaded(version=cmd.version, ok=False,
                                                         error=str(exc)[:500] or type(exc).__name__,
                                                         seconds=time.monotonic() - started, weights_unknown=True))
            self.host.check_engine()
            return
        self.version = cmd.version
        self.link.send(policy_loaded=pb.PolicyLoaded(version=cmd.version, ok=True, seconds=time.monotonic() - started))

    def control(self, call: pb.ControlCall) -> None:
        """Start one engine control call (``_control``); a weight update may block for minutes,
        so the stream's other messages are not held behind it."""
        task = asyncio.create_task(self._control(call))
        self._controls.add(task)
        task.add_done_callback(self._controls.discard)

    async def _control(self, call: pb.ControlCall) -> None:
        """Run one engine control call (vLLM's weight transfer, prefix-cache reset) and answer
        it. Calls run one at a time, in the order they came. ``start_weight_update`` leaves
        the weights unknown (version -1: vLLM rebuilds the layers as they arrive) until
        ``finish_weight_update`` succeeds and sets the version the scheduler gave it (an
        ``abort_weight_update`` leaves them unknown); ``sleep`` drops what runs first, and at
        level 2 (weights discarded) leaves the weights unknown too."""
        async with self._control_lock:
            op = CONTROL_OPS.get(call.op)
            try:
                if op is None:
                    raise ValueError(f"op: unknown control operation {call.op}")
                args = json.loads(call.json or "{}")
                if not isinstance(args, dict):
                    raise TypeError("json: must be a JSON object")
                if op in ("start_weight_update", "sleep"):
                    await self.host.drain()  # no generation spans the weights' change or the sleep (none should run)
                if op == "start_weight_update" or (op == "sleep" and args.get("level") == 2):
                    self.version = -1  # weights in flux, or discarded (sleep level 2): none serves until an update
                result = await self.engine.control(op, args)
                if op == "finish_weight_update":
                    self.version = call.policy_version
            except Exception as exc:
                logger.error("worker %s: %s failed: %s", self.worker_id, op or call.op, exc)
                self.link.send(control_result=pb.ControlResult(call_id=call.call_id, ok=False,
                                                               error=str(exc)[:500] or type(exc).__name__))
                self.host.check_engine()
                return
            self.link.send(control_result=pb.ControlResult(call_id=call.call_id, ok=True, json=json.dumps(result or {})))

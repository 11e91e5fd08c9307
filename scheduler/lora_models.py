"""LoRA adapters as models of the OpenAI routes: which adapter (and version) a call's ``model``
names, after the adapter's load barrier, and its ``/v1/models`` cards (``lora_api.py`` serves
the load and unload routes; the table is the core's, ``core/adapters.py``); and the cluster's
LoRA config, ``/server_info``'s ``lora_config`` (``cluster_lora_config``)."""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from bubblespec.scheduler.core.types import InvalidRequest, StepSpec

if TYPE_CHECKING:
    from bubblespec.scheduler.app import SchedulerApp
    from bubblespec.scheduler.core.adapters import AdapterTable

__all__ = ["ADAPTER_VERSION_HEADER", "MAX_LORA_CONFIG_CHARS", "adapter_cards", "adapter_for", "cluster_lora_config",
           "lora_config_of", "loads_of", "with_adapter"]

ADAPTER_VERSION_HEADER = "X-BubbleSpec-Adapter-Version"
"""The answer's header with the version of the adapter a call ran with."""
MAX_LORA_CONFIG_CHARS = 8192
"""Longest ``Hello.lora_config`` taken (vLLM's dump of a LoRA config is about 400 characters)."""
_LIMITS = ("max_lora_rank", "max_loras", "max_cpu_loras")
"""Capacities of a LoRA config: the cluster's is the smallest of its workers' (a load must fit every worker)."""


class Loads:
    """One adapter table's per-name locks (vLLM's ``lora_resolver_lock``) and load barriers."""

    def __init__(self) -> None:
        self.locks: dict[str, asyncio.Lock] = {}
        self.done: dict[str, asyncio.Event] = {}
        """Loads in progress by name: set when that load ends (either way)."""


_loads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # AdapterTable -> its Loads


def _table(scheduler: SchedulerApp) -> AdapterTable | None:
    return getattr(scheduler.service.core, "adapters", None)  # None: a core without LoRA serves no adapters


def loads_of(table: AdapterTable) -> Loads:
    return _loads.setdefault(table, Loads())


async def adapter_for(scheduler: SchedulerApp, model: str) -> tuple[str, int] | None:
    """(name, version) of the adapter ``model`` names, after any load of it in progress (the
    adapter's barrier: its new requests wait); None where no adapter has that name."""
    table = _table(scheduler)
    if table is None:
        return None
    done = loads_of(table).done.get(model)
    if done is not None:
        await done.wait()
    return table.resolve(model)


def with_adapter(spec: StepSpec, adapter: tuple[str, int]) -> StepSpec:
    """``spec``'s requests, run with ``adapter`` (name, version)."""
    return replace(spec, adapter=adapter)


def adapter_cards(scheduler: SchedulerApp, created: int) -> list[dict]:
    """``/v1/models`` entries of the served adapters, as vLLM's ``show_available_models``."""
    table = _table(scheduler)
    base = scheduler.settings.model_name()
    return [] if table is None else [
        {"id": a.name, "object": "model", "created": created, "owned_by": "vllm", "root": a.path, "parent": base,
         "max_model_len": None} for a in table.served.values()]


def lora_config_of(text: str) -> dict | None:
    """A worker's ``Hello.lora_config`` (vLLM's dump of its engine's LoRA config, JSON; '' = LoRA
    off) as a dict; anything but a JSON object is refused naming ``hello.lora_config``."""
    if not text:
        return None
    if len(text) > MAX_LORA_CONFIG_CHARS:
        raise InvalidRequest("hello.lora_config", f"over {MAX_LORA_CONFIG_CHARS} characters ({len(text)})")
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest("hello.lora_config", f"not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidRequest("hello.lora_config", f"must be a JSON object, got {type(config).__name__}")
    return config


def cluster_lora_config(configs: Iterable[dict | None]) -> dict | None:
    """``/server_info``'s ``lora_config`` from the live workers' (in worker order): None unless
    there is a worker and every one runs with LoRA (a load must succeed on all of them); the
    first worker's config, with each capacity (``max_lora_rank``, ``max_loras``,
    ``max_cpu_loras``) the smallest of the workers'."""
    every = list(configs)
    known = [c for c in every if c is not None]
    if not known or len(known) < len(every):
        return None
    merged = dict(known[0])
    for key in _LIMITS:
        values = [c.get(key) for c in known]
        counts = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        if len(counts) == len(values):
            merged[key] = min(counts)
    return merged

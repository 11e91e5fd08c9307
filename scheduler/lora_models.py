"""LoRA adapters as models of the OpenAI routes: which adapter (and version) a call's ``model``
names, after the adapter's load barrier, and its ``/v1/models`` cards (``lora_api.py`` serves
the load and unload routes; the table is the core's, ``core/adapters.py``)."""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING

from bubblespec.scheduler.core.types import StepSpec

if TYPE_CHECKING:
    from bubblespec.scheduler.app import SchedulerApp
    from bubblespec.scheduler.core.adapters import AdapterTable

__all__ = ["ADAPTER_VERSION_HEADER", "adapter_cards", "adapter_for", "loads_of", "with_adapter"]

ADAPTER_VERSION_HEADER = "X-BubbleSpec-Adapter-Version"
"""The answer's header with the version of the adapter a call ran with."""


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

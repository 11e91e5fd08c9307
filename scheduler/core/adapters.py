"""LoRA adapters as named policies (pure): names, versions, loads in progress, who holds what.

An adapter is served under its name (an OpenAI ``model``), as ``vllm serve --enable-lora``
serves it, beside the base model. Each load of a name is a policy update of that adapter
alone: it gets the next version (1 at the first load, +1 at each reload) and an engine-wide
integer id (vLLM's ``lora_int_id``; a new one per version, so that an engine never mixes two
versions' weights), and while it loads, new requests for that adapter wait (the shell's
barrier, ``AdapterTable.loading``); the base model's and other adapters' requests go on.

A load is fanned out to every worker; it is done when every worker loaded it
(``finish_load``). Where any worker failed, the load ends with an error naming them and the
adapter stays as it was before (``abandon_load``; the shell unloads that version from the
workers that took it). A worker holds the versions it loaded: requests with an adapter go only
to workers that hold its version (``holds``). A worker that connects after a load loads the
current version of every adapter (``missing``, then ``joined``; the shell's
``lora_api.load_on_join``) and takes none of an adapter's requests before; one whose load
fails does not serve that adapter, and the failure is kept (``join_failed``) and named in the
refusal of a request no worker can serve.

Requests name an adapter by (name, version) (``RequestSpec.adapter``): the pool groups them
by adapter and prompt (``core/pool.py``), so siblings, like the worker's history drafts
(``store.prompt_key``) and its live siblings (``worker/proposer.py``), never cross adapters
or versions.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from bubblespec.scheduler.core.types import Action, ErrorCode, InvalidRequest

__all__ = ["MAX_NAME_CHARS", "Adapter", "AdapterCommands", "AdapterTable", "LoadPlan", "check_adapter"]

MAX_NAME_CHARS = 200
"""Longest adapter name accepted."""
_NAME = re.compile(r"[^\s@{}]+")
"""Adapter names: no whitespace, and none of ``@`` (the engine names a version ``name@version``)
or braces (store keys)."""


@dataclass(frozen=True)
class LoadPlan:
    """One load in progress: the version and engine id it will serve as."""

    name: str
    path: str
    version: int
    int_id: int


@dataclass
class Adapter:
    """A served adapter: its current version, where it came from, and the workers that hold
    each version they loaded."""

    name: str
    path: str
    version: int
    int_id: int
    holders: dict[int, set[str]] = field(default_factory=dict)
    """version -> the workers that loaded it (and have not dropped it)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Workers that could not load the current version when they joined -> why."""

    def plan(self) -> LoadPlan:
        """Its current version, as a load of it."""
        return LoadPlan(self.name, self.path, self.version, self.int_id)


class AdapterTable:
    """The adapters the cluster serves (``name -> Adapter``) and the loads in progress."""

    def __init__(self) -> None:
        self.served: dict[str, Adapter] = {}
        self.loading: dict[str, LoadPlan] = {}
        """Loads in progress by name: that adapter's new requests wait for them."""
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ loads --

    def begin_load(self, name: object, path: object, base_model: str, load_inplace: bool = False) -> LoadPlan:
        """Check a ``/v1/load_lora_adapter`` (vLLM's checks and answers: both fields named, not
        the base model's name, a loaded name only with ``load_inplace``) and start it; refused
        (naming the field) with nothing changed."""
        if not name or not path:
            raise InvalidRequest("lora_name", "Both 'lora_name' and 'lora_path' must be provided.")
        if not isinstance(name, str):
            raise InvalidRequest("lora_name", f"must be a string, got {name!r:.40}")
        if not isinstance(path, str):
            raise InvalidRequest("lora_path", f"must be a string, got {path!r:.40}")
        if len(name) > MAX_NAME_CHARS or not _NAME.fullmatch(name):
            raise InvalidRequest("lora_name", f"must be 1 to {MAX_NAME_CHARS} characters without whitespace, '@' "
                                 f"or braces, got {name!r:.60}")
        if name == base_model:
            raise InvalidRequest("lora_name", f"The lora adapter '{name}' conflicts with a served base model.")
        if name in self.loading:
            raise InvalidRequest("lora_name", f"the lora adapter '{name}' is being loaded; retry when that load "
                                 "ends", ErrorCode.FAILED_PRECONDITION)
        current = self.served.get(name)
        if current is not None and not load_inplace:
            raise InvalidRequest("lora_name", f"The lora adapter '{name}' has already been loaded. If you want to "
                                 "load the adapter in place, set 'load_inplace' to True.")
        plan = LoadPlan(name, path, 1 if current is None else current.version + 1, next(self._ids))
        self.loading[name] = plan
        return plan

    def finish_load(self, plan: LoadPlan, workers: set[str]) -> Adapter:
        """Every worker of ``workers`` loaded ``plan``: it is the adapter's current version."""
        if self.loading.get(plan.name) is not plan:
            raise InvalidRequest("lora_name", f"no load of '{plan.name}' is in progress", ErrorCode.FAILED_PRECONDITION)
        del self.loading[plan.name]
        adapter = self.served.get(plan.name)
        if adapter is None:
            adapter = self.served[plan.name] = Adapter(plan.name, plan.path, plan.version, plan.int_id)
        else:
            adapter.path, adapter.version, adapter.int_id = plan.path, plan.version, plan.int_id
        adapter.holders[plan.version] = set(workers)
        adapter.failed = {}
        for old in [v for v in adapter.holders if v < plan.version - 1]:  # workers keep the previous one only
            del adapter.holders[old]
        return adapter

    def abandon_load(self, plan: LoadPlan) -> None:
        """``plan`` failed: the adapter stays as it was before it."""
        if self.loading.get(plan.name) is plan:
            del self.loading[plan.name]

    # ---------------------------------------------------------------- unloads --

    def unload(self, name: object) -> Adapter:
        """Stop serving ``name`` (vLLM's checks: named, and loaded); return what it was."""
        if not name or not isinstance(name, str):
            raise InvalidRequest("lora_name", "'lora_name' needs to be provided to unload a LoRA adapter.")
        if name in self.loading:
            raise InvalidRequest("lora_name", f"the lora adapter '{name}' is being loaded; retry when that load "
                                 "ends", ErrorCode.FAILED_PRECONDITION)
        adapter = self.served.pop(name, None)
        if adapter is None:
            raise InvalidRequest("lora_name", f"The lora adapter '{name}' cannot be found.", ErrorCode.NOT_FOUND)
        return adapter

    # ---------------------------------------------------------------- serving --

    def resolve(self, model: str) -> tuple[str, int] | None:
        """(name, current version) of the adapter named ``model``; None where none is served
        under that name (a load in progress counts as not yet served: the shell waits on it)."""
        adapter = self.served.get(model)
        return None if adapter is None else (adapter.name, adapter.version)

    def holds(self, worker_id: str, adapter: tuple[str, int]) -> bool:
        """Whether ``worker_id`` holds that adapter version (it may run its requests)."""
        served = self.served.get(adapter[0])
        return served is not None and worker_id in served.holders.get(adapter[1], ())

    def left(self, worker_id: str) -> None:
        """``worker_id`` left: it holds nothing (an engine that comes back starts without adapters)."""
        for adapter in self.served.values():
            adapter.failed.pop(worker_id, None)
            for holders in adapter.holders.values():
                holders.discard(worker_id)

    # ---------------------------------------------------------------- joining --

    def missing(self, worker_id: str, name: str) -> LoadPlan | None:
        """The current version of adapter ``name`` where ``worker_id`` (connected after its load)
        does not hold it: what it loads before it takes the adapter's requests; None where it
        holds it, or no adapter has that name."""
        adapter = self.served.get(name)
        if adapter is None or worker_id in adapter.holders.get(adapter.version, ()):
            return None
        return adapter.plan()

    def joined(self, worker_id: str, plan: LoadPlan) -> bool:
        """``worker_id`` loaded ``plan``: it holds that version and takes its requests. False
        (nothing changed) where ``plan`` is no longer the adapter's current version."""
        adapter = self.served.get(plan.name)
        if adapter is None or adapter.version != plan.version or adapter.int_id != plan.int_id:
            return False
        adapter.holders.setdefault(plan.version, set()).add(worker_id)
        adapter.failed.pop(worker_id, None)
        return True

    def join_failed(self, worker_id: str, plan: LoadPlan, reason: str) -> None:
        """``worker_id`` could not load ``plan``: it serves none of that adapter's requests, and
        the refusal of a request that no worker can serve names it (``check_adapter``)."""
        adapter = self.served.get(plan.name)
        if adapter is not None and adapter.version == plan.version:
            adapter.failed[worker_id] = reason[:300]


def check_adapter(table: AdapterTable, adapter: tuple[str, int], workers: Collection[str]) -> None:
    """Refuse (naming ``model``) requests for an adapter version that is not served now, or that
    no connected worker of ``workers`` (ids) holds."""
    name, version = adapter
    served = table.served.get(name)
    if served is None:
        raise InvalidRequest("model", f"The model `{name}` does not exist.", ErrorCode.NOT_FOUND)
    if served.version != version:
        raise InvalidRequest("model", f"adapter '{name}' is at version {served.version}, not {version}",
                             ErrorCode.FAILED_PRECONDITION)
    if not any(table.holds(wid, adapter) for wid in workers):
        failed = "; ".join(f"worker {wid} could not load it: {why}" for wid, why in sorted(served.failed.items())
                           if wid in workers)
        raise InvalidRequest("model", f"no connected worker holds adapter '{name}' version {version}"
                             f"{f' ({failed})' if failed else ' (a worker that connects loads it first)'}; "
                             "retry, or load it again", ErrorCode.UNAVAILABLE)


class AdapterCommands:
    """The core's public LoRA API (``SchedulerCore`` inherits it): the table the shell's load
    and unload routes drive (``scheduler/lora_api.py``), and the unload that fails queued requests."""

    pool: Any  # the core's RequestPool (core/pool.py, which imports this module)

    @property
    def adapters(self) -> AdapterTable:
        """The served adapters and the loads in progress."""
        return self.pool.adapters

    def unload_adapter(self, name: object) -> list[Action]:
        """Stop serving ``name``: its queued requests fail naming ``model`` (``RequestPool.unload_adapter``)."""
        return self.pool.unload_adapter(name)

"""LoRA adapters on a worker's vLLM engine: the versions it holds, their load and unload.

The scheduler names an adapter and gives each load of a name a version (1 at its first load,
+1 at each reload) and an engine-wide integer id. The engine knows each version as its own vLLM
``LoRARequest`` named ``<name>@<version>``: vLLM's prefix cache keys blocks by the adapter's
name and path, so KV computed under one version never serves another, even where a trainer
saves each version to the same directory. A request names (adapter, version) and runs only
where that version is held (``LoraAdapters.request`` refuses any other, naming what is held).

A reload keeps the previous version until the next one of that name succeeds, so that requests
still running under it finish with its weights; older ones are dropped from the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["LOAD_OP", "UNLOAD_OP", "LoraAdapters", "LoraVersion"]

LOAD_OP = "load_lora_adapter"
UNLOAD_OP = "unload_lora_adapter"
MAX_NAME_CHARS = 200
_T = TypeVar("_T")


@dataclass(frozen=True)
class LoraVersion:
    """One loaded version of an adapter."""

    name: str
    version: int
    int_id: int
    path: str

    @property
    def engine_name(self) -> str:
        """The name vLLM knows it by (its prefix-cache key with ``path``)."""
        return f"{self.name}@{self.version}"

    def vllm_request(self) -> LoRARequest:
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.engine_name, self.int_id, self.path)


def _arg(args: dict, name: str, kind: type[_T]) -> _T:
    value = args.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is str and not value):
        raise ValueError(f"{name}: must be a{'' if kind is int else ' non-empty'} {kind.__name__}, got {value!r:.60}")
    return value


class LoraAdapters:
    """The adapter versions an engine holds (``name -> version -> LoraVersion``)."""

    def __init__(self) -> None:
        self.held: dict[str, dict[int, LoraVersion]] = {}

    def request(self, name: str, version: int) -> LoRARequest:
        """vLLM's ``LoRARequest`` for (``name``, ``version``); a version not held is refused by name."""
        held = self.held.get(name, {})
        if version not in held:
            have = ", ".join(str(v) for v in sorted(held)) or "none"
            raise ValueError(f"adapter: {name!r:.{MAX_NAME_CHARS}} version {version} is not loaded on this worker "
                             f"(versions held: {have})")
        return held[version].vllm_request()

    async def control(self, llm: AsyncLLM, op: str, args: dict) -> dict:
        """Run ``load_lora_adapter`` or ``unload_lora_adapter`` (``ControlOp``'s JSON) on ``llm``
        (vLLM's ``AsyncLLM``)."""
        if op == LOAD_OP:
            return await self._load(llm, args)
        name = _arg(args, "lora_name", str)
        version = args.get("version")
        held = self.held.get(name, {})
        drop = [v for v in held if version is None or v == version]
        for v in drop:
            await llm.remove_lora(held[v].int_id)
            del held[v]
        if not held:
            self.held.pop(name, None)
        return {"removed": sorted(drop)}

    async def _load(self, llm: AsyncLLM, args: dict) -> dict:
        import os

        name, path = _arg(args, "lora_name", str), _arg(args, "lora_path", str)
        version, int_id = _arg(args, "version", int), _arg(args, "lora_int_id", int)
        if version < 1 or int_id < 1:
            raise ValueError(f"version, lora_int_id: must be >= 1, got {version}, {int_id}")
        if not os.path.isdir(path):
            raise ValueError(f"lora_path: {path!r:.300} is not a directory on this worker")
        lora = LoraVersion(name, version, int_id, path)
        if not await llm.add_lora(lora.vllm_request()):  # vLLM loads and checks the weights here
            raise RuntimeError(f"vLLM did not add adapter {name!r:.{MAX_NAME_CHARS}} from {path!r:.300}")
        held = self.held.setdefault(name, {})
        held[version] = lora
        for old in [v for v in held if v < version - 1]:  # the previous version stays for requests still on it
            await llm.remove_lora(held.pop(old).int_id)
        return {"loaded": version}

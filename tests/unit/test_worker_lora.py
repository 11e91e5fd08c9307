"""The versions of LoRA adapters a worker's engine holds (``worker/lora.py``), against a
recording stand-in for vLLM's ``AsyncLLM`` (its ``add_lora``/``remove_lora``): arguments checked
by name, one vLLM adapter per version, the previous version kept for requests still on it."""

from __future__ import annotations

import pytest

from bubblespec.worker.lora import LOAD_OP, UNLOAD_OP, LoraAdapters


class RecordingLLM:
    def __init__(self, accept: bool = True):
        self.accept = accept
        self.added: list = []
        self.removed: list[int] = []

    async def add_lora(self, request) -> bool:
        self.added.append(request)
        return self.accept

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True


def load(name: str, path: str, version: int, int_id: int) -> dict:
    return {"lora_name": name, "lora_path": path, "version": version, "lora_int_id": int_id}


async def test_each_version_is_its_own_vllm_adapter_and_the_one_before_stays(tmp_path):
    llm, held = RecordingLLM(), LoraAdapters()
    for v in (1, 2, 3):
        assert await held.control(llm, LOAD_OP, load("math", str(tmp_path), v, 10 + v)) == {"loaded": v}
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in llm.added] == [
        ("math@1", 11, str(tmp_path)), ("math@2", 12, str(tmp_path)), ("math@3", 13, str(tmp_path))]
    assert llm.removed == [11] and sorted(held.held["math"]) == [2, 3]
    assert held.request("math", 2).lora_name == "math@2"
    with pytest.raises(ValueError, match=r"'math' version 1 is not loaded on this worker \(versions held: 2, 3\)"):
        held.request("math", 1)
    assert await held.control(llm, UNLOAD_OP, {"lora_name": "math", "version": 3}) == {"removed": [3]}
    assert await held.control(llm, UNLOAD_OP, {"lora_name": "math", "version": None}) == {"removed": [2]}
    assert held.held == {} and llm.removed == [11, 13, 12]


@pytest.mark.parametrize(("args", "field"), [
    ({"lora_path": "/", "version": 1, "lora_int_id": 1}, "lora_name"),
    ({"lora_name": "m", "version": 1, "lora_int_id": 1}, "lora_path"),
    ({"lora_name": "m", "lora_path": "/", "version": "1", "lora_int_id": 1}, "version"),
    ({"lora_name": "m", "lora_path": "/", "version": 1, "lora_int_id": True}, "lora_int_id"),
    ({"lora_name": "m", "lora_path": "/nonexistent/adapter", "version": 1, "lora_int_id": 1}, "lora_path"),
])
async def test_bad_loads_name_the_field_and_reach_no_engine(args, field):
    llm, held = RecordingLLM(), LoraAdapters()
    with pytest.raises(ValueError, match=f"^{field}: "):
        await held.control(llm, LOAD_OP, args)
    assert llm.added == [] and held.held == {}


async def test_an_adapter_vllm_refuses_is_not_held(tmp_path):
    llm, held = RecordingLLM(accept=False), LoraAdapters()
    with pytest.raises(RuntimeError, match="vLLM did not add adapter 'm'"):
        await held.control(llm, LOAD_OP, load("m", str(tmp_path), 1, 1))
    assert held.held == {}

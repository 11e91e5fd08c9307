"""Policy updates that fail, on the real cluster: two vLLM CPU workers, real gRPC, the SDK.

A failed update fails loudly (``PreconditionFailed`` naming every worker and its reason) and
changes nothing: the cluster keeps its version, the old weights keep serving the same greedy
outputs, and the same version can then be loaded from a good path. Every test ends with the
cluster at a fresh version loaded from the tiny model (the cluster is shared by the session).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from bubblespec.client import AlreadyExists, PreconditionFailed
from tests.factories import GREEDY, token_prompts

pytestmark = pytest.mark.vllm


async def greedy(client, cluster, name: str, ids) -> list[tuple[int, ...]]:
    v = cluster.scheduler.core.version
    result = await client.generate(f"{name}-v{v}", ids, GREEDY, policy_version=v)
    assert all(c.policy_version == v for c in result.completions)
    return [c.token_ids for c in result.completions]


async def restore(client, cluster, tiny_model: str) -> None:
    await client.update_policy(cluster.scheduler.core.version + 1, tiny_model)


def assert_names_every_worker(cluster, message: str, reason: str) -> None:
    for wid in cluster.scheduler.core.workers:
        assert f"worker {wid}: " in message, message
    assert message.count(reason) == len(cluster.scheduler.core.workers), message


async def test_update_from_a_missing_directory_fails_and_changes_nothing(cluster, client, tiny_model, tmp_path):
    core = cluster.scheduler.core
    v, path = core.version, core.weights_path
    start_weights = path in ("", tiny_model)  # the workers start from the tiny model
    ids = token_prompts(4, seed=811)
    before = await greedy(client, cluster, "pu-missing-before", ids)
    try:
        with pytest.raises(PreconditionFailed) as err:
            await asyncio.wait_for(client.update_policy(v + 1, str(tmp_path / "no-such-dir")), 300)
        assert err.value.field == "weights_path"
        assert_names_every_worker(cluster, err.value.message, "is not a directory")
        assert (await client.status())["policy_version"] == v and (core.version, core.weights_path) == (v, path)
        assert all(w.version == v and w.load_failed is None for w in core.workers.values())
        assert await greedy(client, cluster, "pu-missing-after", ids) == before  # the old weights serve, unchanged
        good = shutil.copytree(tiny_model, tmp_path / "good")
        assert await asyncio.wait_for(client.update_policy(v + 1, str(good)), 300) == 2  # same version, good path
        assert (await client.status())["policy_version"] == v + 1
        if start_weights:
            assert await greedy(client, cluster, "pu-missing-retried", ids) == before
    finally:
        await restore(client, cluster, tiny_model)


async def test_partial_checkpoint_is_refused_naming_the_missing_tensor(cluster, client, tiny_model, tmp_path):
    core = cluster.scheduler.core
    v = core.version
    partial = Path(shutil.copytree(tiny_model, tmp_path / "partial"))
    tensors = load_file(str(partial / "model.safetensors"))
    missing = "model.layers.1.mlp.down_proj.weight"
    del tensors[missing]  # a checkpoint still being written: vLLM alone would only warn and load the rest
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    ids = token_prompts(4, seed=812)
    before = await greedy(client, cluster, "pu-partial-before", ids)
    try:
        with pytest.raises(PreconditionFailed) as err:
            await asyncio.wait_for(client.update_policy(v + 1, str(partial)), 300)
        assert err.value.field == "weights_path"
        assert_names_every_worker(cluster, err.value.message, f"tensor '{missing}' is missing")
        assert core.version == v
        assert await greedy(client, cluster, "pu-partial-after", ids) == before
    finally:
        await restore(client, cluster, tiny_model)


async def test_same_update_twice_gets_the_same_answer(cluster, client, tiny_model, tmp_path):
    core = cluster.scheduler.core
    v = core.version + 1
    weights = str(shutil.copytree(tiny_model, tmp_path / "same"))
    try:
        # the second call arrives while the first loads (it joins) or after it (the same answer)
        first, second = await asyncio.wait_for(asyncio.gather(
            client.update_policy(v, weights), client.update_policy(v, weights)), 300)
        assert first == second == 2
        assert await client.update_policy(v, weights) == 2
        assert (core.version, core.weights_path) == (v, weights)
        with pytest.raises(AlreadyExists) as err:
            await client.update_policy(v, tiny_model)
        assert err.value.field == "weights_path"
        assert (core.version, core.weights_path) == (v, weights)
    finally:
        await restore(client, cluster, tiny_model)

"""A short TRL ``GRPOTrainer`` run on CPU with rollouts through BubbleSpec: ``vllm_mode="server"``
pointed at the real cluster's HTTP port, weights synced through ``DirectoryWeightSync``
(``/update_weights {"weight_dir"}``: TRL's NCCL path refuses a CPU trainer), next rounds
announced by ``BubbleSpecLookahead``.

The cluster is shared by the session: the test ends with it at a fresh version loaded from the
tiny model, as the other modules expect. The trainer is blocking and the scheduler runs on this
test's event loop, so the trainer runs in a thread.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("trl")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [f"{a}+{b}=" for a in range(3) for b in range(4)]  # 12 text prompts
STEPS = 3


def _reward(completions, **kwargs) -> list[float]:
    return [float(sum(map(ord, c)) % 7) for c in completions]  # varied: nonzero advantages, real gradients


class StepSpy:
    """Wraps ``service.run_requests``: the spec of each call the HTTP routes ran, and the policy
    versions of the completions it returned."""

    def __init__(self, service):
        self.real, self.steps = service.run_requests, []

    async def __call__(self, spec, *args, **kwargs):
        record = {"spec": spec, "versions": set(), "completions": 0}
        self.steps.append(record)
        async for index, c in self.real(spec, *args, **kwargs):
            record["versions"].add(c.policy_version)
            record["completions"] += 1
            yield index, c


def _train(base_url: str, target: str, tiny_model: str, out_dir: str, weights: str):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from bubblespec.integrations.trl import BubbleSpecLookahead, DirectoryWeightSync

    args = GRPOConfig(output_dir=out_dir, report_to="none", use_cpu=True, save_strategy="no", logging_steps=1,
                      max_steps=STEPS, per_device_train_batch_size=4, num_generations=2, max_completion_length=8,
                      learning_rate=1e-2, seed=5, use_vllm=True, vllm_mode="server", vllm_server_base_url=base_url,
                      vllm_server_timeout=30)
    lookahead = BubbleSpecLookahead(target, steps=1)
    with DirectoryWeightSync.installed(weights, keep=STEPS):
        trainer = GRPOTrainer(model=tiny_model, reward_funcs=_reward, args=args,
                              train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                              processing_class=AutoTokenizer.from_pretrained(tiny_model), callbacks=[lookahead])
    trainer.train()
    return trainer, lookahead


async def test_grpo_trainer_rolls_out_through_bubblespec(cluster, tiny_model, tmp_path, monkeypatch):
    core = cluster.scheduler.core
    spy = StepSpy(cluster.scheduler.service)
    monkeypatch.setattr(cluster.scheduler.service, "run_requests", spy)
    base_url = f"http://127.0.0.1:{cluster.scheduler.http_port}"
    v0 = core.version
    try:
        trainer, lookahead = await asyncio.to_thread(_train, base_url, cluster.target, tiny_model,
                                                     str(tmp_path / "out"), str(tmp_path / "weights"))
    finally:
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
            r = await http.post("/update_weights", json={"weight_dir": tiny_model})
            assert r.status_code == 200, r.text
    sync = trainer.vllm_generation
    # one weight sync before each of the 3 generation rounds, each one policy version, each round at it
    assert len(sync.synced_dirs) == STEPS
    assert core.version == v0 + STEPS + 1  # + the restore above
    assert [s["spec"].policy_version for s in spy.steps] == [v0 + 1, v0 + 2, v0 + 3]
    assert [s["versions"] for s in spy.steps] == [{v0 + 1}, {v0 + 2}, {v0 + 3}]
    assert [s["completions"] for s in spy.steps] == [4, 4, 4]  # 2 prompts x num_generations 2, each once
    assert all(s["spec"].step_id.startswith("http-") for s in spy.steps)
    # the trainer learned from them: a loss per step, and the last sync sent weights that moved
    assert len([e for e in trainer.state.log_history if "loss" in e]) == STEPS
    first, last = (load_file(str(d / "model.safetensors")) for d in (sync.synced_dirs[0], sync.synced_dirs[-1]))
    assert first.keys() == last.keys() and any(not torch.equal(first[k], last[k]) for k in first)
    # the lookahead announced each round's prompts, token for token, before TRL sent them
    sent = [[list(p.token_ids) for p in s["spec"].prompts] for s in spy.steps]
    assert lookahead.exact is True and lookahead.failures == 0, lookahead.last_error
    assert [lookahead.announced_rounds[r] for r in range(STEPS)] == sent

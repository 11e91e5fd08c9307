"""A short TRL ``AsyncGRPOTrainer`` run (``trl.experimental.async_grpo``) on CPU with rollouts
through BubbleSpec: TRL's rollout child process posts ``/v1/completions`` (token-id prompts,
``return_token_ids``, ``logprobs=0``, a 63-bit seed each) to the real cluster's HTTP port, and
each weight sync is TRL's ``/pause?mode=keep`` + ``/resume`` around ``DirectoryWeightTransfer``'s
``/update_weights {"weight_dir"}`` (TRL's NCCL transfer needs a CUDA trainer). ``async_grpo_on_cpu``
runs the trainer's tree attention in torch (TRL's FlashAttention-3 kernel needs a GPU) and skips
its CUDA-only peak-FLOPs lookup.

The rollouts name the model by the path the trainer loaded (vLLM's default served name), which
the scheduler, started with that path as its tokenizer, serves. The cluster is shared by the
session: the test ends with it resumed, at a fresh version loaded from the tiny model. The
trainer is blocking and the scheduler runs on this test's event loop, so the trainer runs in a
thread.
"""

from __future__ import annotations

import asyncio
import math
import re

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from tests.integration.test_trl_grpo import StepSpy

pytest.importorskip("trl")
pytest.importorskip("aiohttp")

PROMPTS = [[{"role": "user", "content": f"{a}+{b}="}] for a in range(3) for b in range(4)]  # 12 conversations
STEPS = 3
PROBE = {"prompt": "1+2=", "max_tokens": 4, "temperature": 0, "logprobs": 0, "return_token_ids": True}


def char_reward(completions, **kwargs) -> list[float]:
    """Varied rewards (nonzero advantages, real gradients); module-level: TRL pickles it into its rollout child."""
    return [float(sum(map(ord, str(c))) % 7) for c in completions]


def _train(base_url: str, tiny_model: str, out_dir: str, weights: str):
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from bubblespec.integrations.trl import DirectoryWeightTransfer, async_grpo_on_cpu

    # max_staleness=0: a step trains only on rollouts begun under the policy it pushed last, so
    # every pushed version must be rolled out; token_budget=0: fixed micro-batches of 4 samples
    args = AsyncGRPOConfig(output_dir=out_dir, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
                           logging_steps=1, max_steps=STEPS, per_device_train_batch_size=4, num_generations=2,
                           max_completion_length=8, learning_rate=1e-2, seed=5, vllm_server_base_url=base_url,
                           vllm_server_timeout=30, request_timeout=120, token_budget=0, max_staleness=0,
                           max_inflight_tasks=4, queue_maxsize=4, weight_sync_steps=1)
    transfer = DirectoryWeightTransfer(base_url, weights, tiny_model, keep=STEPS + 1)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    # TRL's rollout worker parses each completion into a message; it knows the templates of known
    # model families only, so the tiny model's is given: plain text up to the end-of-sequence token
    tok.response_template = {"defaults": {"role": "assistant"}, "start_anchor": "assistant\n",
                             "fields": {"content": {"close_pattern": re.escape(tok.eos_token) + r"\s*|$",
                                                    "content": "text"}}}
    with async_grpo_on_cpu():
        trainer = AsyncGRPOTrainer(model=tiny_model, reward_funcs=char_reward, args=args,
                                   train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                                   processing_class=tok, weight_transfer=transfer)
        trainer.train()
    return trainer, transfer


async def _probe(http: httpx.AsyncClient, model: str) -> tuple[list[int], list[float]]:
    r = await http.post("/v1/completions", json={**PROBE, "model": model})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@pytest.mark.vllm
@pytest.mark.timeout(600)
async def test_async_grpo_trainer_rolls_out_through_bubblespec(cluster, tiny_model, tmp_path, monkeypatch):
    core, scheduler = cluster.scheduler.core, cluster.scheduler
    base_url = f"http://127.0.0.1:{scheduler.http_port}"
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        before = await _probe(http, tiny_model)
        spy = StepSpy(scheduler.service)
        monkeypatch.setattr(scheduler.service, "run_requests", spy)
        v0 = core.version
        try:
            trainer, transfer = await asyncio.to_thread(_train, base_url, tiny_model, str(tmp_path / "out"),
                                                        str(tmp_path / "weights"))
            monkeypatch.undo()
            trained = await _probe(http, tiny_model)
        finally:
            monkeypatch.undo()
            if (await http.get("/is_paused")).json()["is_paused"]:
                assert (await http.post("/resume")).status_code == 200
            r = await http.post("/update_weights", json={"weight_dir": tiny_model})
            assert r.status_code == 200, r.text
        restored = await _probe(http, tiny_model)

    # one sync at train begin and one after each step, each one policy version (+ the restore above)
    assert len(transfer.synced_dirs) == STEPS + 1
    assert core.version == v0 + STEPS + 2
    # every rollout went through the scheduler's HTTP routes, one completion per request (TRL's n=1) ...
    rollouts = [s for s in spy.steps if s["completions"]]
    assert len(rollouts) >= STEPS * 4 and all(s["completions"] == 1 for s in rollouts)
    assert all(s["spec"].step_id.startswith("http-") for s in rollouts)
    # the chat-templated prompts as token ids, each request with its own 63-bit seed, TRL's sampling
    tok = AutoTokenizer.from_pretrained(tiny_model)
    templated = {tuple(tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False)) for p in PROMPTS}
    assert all(len(s["spec"].prompts) == 1 and s["spec"].prompts[0].token_ids in templated for s in rollouts)
    seeds = [s["spec"].sampling.seed for s in rollouts]
    assert len(set(seeds)) == len(seeds) and all(0 <= x < 2**63 for x in seeds)
    assert {(s["spec"].sampling.n, s["spec"].sampling.max_tokens, s["spec"].sampling.temperature) for s in rollouts} \
        == {(1, 8, 1.0)}
    # ... under the versions the trainer pushed (none under the weights before the first sync),
    # each of the 3 trained versions rolled out (max_staleness=0 drops anything older)
    seen = set().union(*(s["versions"] for s in rollouts))
    assert {v0 + 1, v0 + 2, v0 + 3} <= seen <= set(range(v0 + 1, v0 + STEPS + 2))
    # the trainer learned from them: finite loss and metrics per step, fresh samples only
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == STEPS
    for e in logs:
        assert all(math.isfinite(e[k]) for k in ("loss", "kl", "entropy", "reward")), e
        assert e["sample/staleness_max"] == 0, e
    # the pushed weights moved, and the workers served them: the probe answered differently
    # after training and as before once the tiny model was loaded back
    first, last = (load_file(str(d / "model.safetensors")) for d in (transfer.synced_dirs[0], transfer.synced_dirs[-1]))
    assert first.keys() == last.keys() and any(not torch.equal(first[k], last[k]) for k in first)
    assert restored[0] == before[0] and restored[1] == pytest.approx(before[1], abs=1e-3)
    assert trained[0] != before[0] or trained[1] != pytest.approx(before[1], abs=1e-2)


def test_torch_tree_attention_matches_unpacked_forward(tiny_model):
    """TRL's tree packing run under ``async_grpo_on_cpu`` scores each sample as the plain model
    forward does: two samples sharing a prefix, packed into one trie."""
    import numpy as np
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow, register_tree_attention
    from trl.trainer.utils import add_fused_lm_head

    from bubblespec.integrations.trl import async_grpo_on_cpu

    register_tree_attention()
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=TREE_ATTENTION).eval()
    add_fused_lm_head(model, outputs=("log_probs",))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    samples = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12]]
    row = TreeRow()
    for i, ids in enumerate(samples):
        row.add({"input_ids": np.array(ids), "completion_mask": np.array([0, 0] + [1] * (len(ids) - 2)),
                 "old_log_probs": np.zeros(len(ids), dtype=np.float32), "advantage": 1.0, "group_id": i})
    packed = row.pack()
    assert len(packed["input_ids"]) < sum(map(len, samples))  # the shared prefix is forwarded once
    with torch.no_grad(), async_grpo_on_cpu():
        out = model(input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
                    shift_labels=packed["shift_labels"][None], fused_lm_head=True,
                    tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
                    tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
                    tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
                    tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]))
        tree = out.log_probs.flatten()[packed["token_index"]]
        expected = []
        for ids in samples:
            logits = plain(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
            expected += [logits[p - 1, ids[p]] for p in range(2, len(ids))]
    torch.testing.assert_close(tree, torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_requests_may_name_the_model_as_vllm_serves_it():
    """vLLM's default served name is the model string it was started with (TRL's async rollouts
    send the path the trainer loaded); BubbleSpec's default is that path's last component, and
    takes both. A configured ``served_model_name`` is the only name."""
    from bubblespec.scheduler.settings import SchedulerSettings

    s = SchedulerSettings(tokenizer="/models/tiny")
    assert s.model_name() == "tiny"
    assert all(s.serves_model(n) for n in ("tiny", "/models/tiny", "/models/tiny/"))
    assert not any(s.serves_model(n) for n in ("/models/other", "models/tiny", None, ["tiny"]))
    named = SchedulerSettings(tokenizer="/models/tiny", served_model_name="policy")
    assert named.serves_model("policy") and not named.serves_model("/models/tiny") and not named.serves_model("tiny")

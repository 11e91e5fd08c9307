"""The mini RLVR workload: task determinism, rewards, the length tail, and a training smoke."""

import pytest

from bubblespec.bench import rlvr
from bubblespec.bench.tiny_model import TINY_VOCAB


def test_prompts_are_deterministic_by_seed():
    assert rlvr.make_prompts(50, seed=3) == rlvr.make_prompts(50, seed=3)
    assert rlvr.make_prompts(50, seed=3) != rlvr.make_prompts(50, seed=4)
    assert rlvr.make_prompts(80, seed=3)[:50] == rlvr.make_prompts(50, seed=3)


def test_target_writes_every_step_then_the_answer():
    assert rlvr.target("a7+b12+c3=") == "b:7+12=19;c:19+3=22;#22"
    assert rlvr.target("a4+b9=") == "b:4+9=13;#13"


def test_prompts_and_targets_use_only_the_tiny_vocabulary():
    chars = set(TINY_VOCAB)
    for p in rlvr.make_prompts(300, seed=0):
        assert set(p) <= chars and set(rlvr.target(p)) <= chars
        assert rlvr.decode(rlvr.encode(p)) == p
        assert 2 <= len(rlvr.parse_prompt(p)) <= 40


@pytest.mark.parametrize("bad", ["", "7+12=", "a7+c3=", "a7+b1", "a7=", "a7+bx="])
def test_malformed_prompts_are_refused(bad):
    with pytest.raises(ValueError):
        rlvr.parse_prompt(bad)


def test_reward_right_wrong_and_malformed():
    p = "a7+b12+c3="
    assert rlvr.reward(p, rlvr.target(p)) == 1.0
    assert rlvr.reward(p, "#22") == 1.0  # the final answer is what is verified
    assert rlvr.reward(p, rlvr.target(p) + "</s>") == 1.0
    assert rlvr.reward(p, "b:7+12=19;c:19+3=23;#23") == 0.0
    for malformed in ("", "b:7+12=19;c:19+3=22;", "#22;", "#2 2", "#twenty-two", "b:7+12=19;c:19+3=22;#22x"):
        assert rlvr.reward(p, malformed) == 0.0, malformed


def test_step_credit_counts_correct_leading_steps():
    p = "a7+b12+c3="
    assert rlvr.reward(p, "b:7+12=19;c:19+3=23;#23", step_credit=0.5) == pytest.approx(0.25)
    assert rlvr.reward(p, "b:7+12=20;c:20+3=23;#23", step_credit=0.5) == 0.0
    assert rlvr.reward(p, "b:7+12=19;c:19+3=22;", step_credit=0.5) == pytest.approx(0.5)
    assert rlvr.reward(p, rlvr.target(p), step_credit=0.5) == 1.0


def test_response_lengths_are_long_tailed():
    lengths = [len(rlvr.target(p)) + 1 for p in rlvr.make_prompts(4000, seed=0)]
    stats = rlvr.length_stats(lengths)
    assert stats["p50"] <= 30
    assert stats["p95"] / stats["p50"] >= 4
    assert stats["max"] / stats["p50"] >= 12
    assert stats["max"] + 120 <= 1024  # longest prompt + response fits max_model_len


def test_train_smoke_is_deterministic_and_writes_a_loadable_model(tmp_path):
    import hashlib

    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    settings = rlvr.TrainSettings(batch_tokens=512, pool_size=64, warmup_steps=2, log_every=0)
    digests = []
    for name in ("a", "b"):
        stats = rlvr.train_rlvr_model(tmp_path / name, seed=1, steps=2, settings=settings)
        assert stats["final_loss"] > 0 and stats["parameters"] > 0
        digests.append(hashlib.sha256((tmp_path / name / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    model = LlamaForCausalLM.from_pretrained(str(tmp_path / "a"), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert model.config.head_dim == settings.head_dim and model.config.eos_token_id == rlvr.EOS_ID
    prompt = "a7+b12+c3="
    assert tok.encode(prompt, add_special_tokens=False) == rlvr.encode(prompt)
    [response] = rlvr.sample_responses(model, [prompt], temperature=1.0, max_new_tokens=8)
    assert 1 <= len(response) <= 8
    assert 0.0 < rlvr.mean_token_entropy(model, [prompt], [rlvr.encode(rlvr.target(prompt)) + [rlvr.EOS_ID]])


def _grpo_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "grpo_trainer.py"
    spec = importlib.util.spec_from_file_location("grpo_trainer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_example_advantages_and_micro_batches():
    grpo = _grpo_example()
    adv = grpo.group_advantages(["p", "p", "q", "q"], [1.0, 0.0, 1.0, 1.0])
    assert adv[0] == pytest.approx(1.0, abs=1e-3) and adv[1] == pytest.approx(-1.0, abs=1e-3)
    assert adv[2:] == [0.0, 0.0]  # a group with one reward teaches nothing
    batches = grpo.micro_batches([10, 300, 12, 11, 290], budget=600)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4]
    assert all(len(b) * max([10, 300, 12, 11, 290][i] for i in b) <= 600 or len(b) == 1 for b in batches)

"""bench/pass_cost.py: the fit of the GPU profile's constants, and the measured pass itself (on
the CPU, a 2-layer model): a verification pass scores each position as plain decoding would."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from bubblespec.bench.pass_cost import TINY, Model, fit_profile, main


def _report(base: float, per_seq: float, per_draft: float, per_prompt: float) -> dict:
    decode = [{"batch": b, "k": k, "ctx": 1024, "seconds": base + per_seq * b + per_draft * b * k}
              for b in (1, 4, 16, 64, 256) for k in (0, 2, 8, 32)]
    prefill = [{"tokens": p, "seconds": 1e-3 + per_prompt * p} for p in (128, 512, 2048)]
    return {"ctx": 1024, "decode": decode, "prefill": prefill}


def test_fit_recovers_linear_constants_and_lists_the_points_beyond_the_budget() -> None:
    fit = fit_profile(_report(7.5e-3, 2.2e-4, 3.6e-5, 3.1e-5))
    assert fit["base_seconds"] == pytest.approx(7.5e-3)
    assert fit["per_seq_seconds"] == pytest.approx(2.2e-4)
    assert fit["per_draft_token_seconds"] == pytest.approx(3.6e-5)
    assert fit["prefill_per_token_seconds"] == pytest.approx(3.1e-5)
    assert fit["max_rel_error"] < 1e-9
    used = sum(1 for b in (1, 4, 16, 64, 256) for k in (0, 2, 8, 32) if b * k <= 256)
    assert fit["points_used"] == used
    assert {(o["batch"], o["k"]) for o in fit["outside"]} == {(b, k) for b in (1, 4, 16, 64, 256)
                                                              for k in (0, 2, 8, 32) if b * k > 256}


def test_fit_refuses_points_that_cannot_determine_the_constants() -> None:
    r = _report(7.5e-3, 2.2e-4, 3.6e-5, 3.1e-5)
    with pytest.raises(ValueError, match="decode points"):
        fit_profile({**r, "decode": [p for p in r["decode"] if p["batch"] == 4]})
    with pytest.raises(ValueError, match="prefill points"):
        fit_profile({**r, "prefill": r["prefill"][:1]})


@pytest.mark.parametrize("attention", ["auto", "math", "flash"])
@pytest.mark.parametrize("kv_heads", [4, 2])  # multi-head and grouped-query attention
def test_a_verification_pass_scores_each_position_as_decoding_one_at_a_time(kv_heads: int, attention: str) -> None:
    torch.manual_seed(0)
    model = Model(replace(TINY, kv_heads=kv_heads), "cpu", torch.float32)
    model.attention = attention
    ctx, q_len, batch = 20, 4, 3
    model.prepare(batch, ctx, q_len, 1 << 30)
    tokens = torch.randint(0, TINY.vocab, (batch, q_len))
    together = model.forward(tokens)
    caches, rope = [(k.clone(), v.clone()) for k, v in model.caches], model.rope
    one_at_a_time = []
    for i in range(q_len):  # the cache up to position ctx + i, and the rotary angle of that position
        model.caches = [(k[:, :, :ctx + i + 1].clone(), v[:, :, :ctx + i + 1].clone()) for k, v in caches]
        model.mask, model.ctx, model.rope = None, ctx + i, (rope[0][i:i + 1], rope[1][i:i + 1])
        one_at_a_time.append(model.forward(tokens[:, i:i + 1])[:, 0])
    assert torch.equal(together, torch.stack(one_at_a_time, dim=1))


def test_the_cpu_smoke_run_measures_every_point_and_fits_them(tmp_path) -> None:
    out = tmp_path / "report.json"
    assert main(["--device", "cpu", "--tiny", "--ctx", "64", "--batches", "1,4", "--draft-lengths", "0,4",
                 "--contexts", "32", "--context-batches", "1", "--prefill", "16,64", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(p["batch"], p["k"]) for p in report["decode"]] == [(1, 0), (1, 4), (4, 0), (4, 4)]
    assert all(p["seconds"] > 0 for p in report["decode"] + report["prefill"] + report["context"])
    assert report["fit"]["points_used"] == 4 and len(report["context"]) == 2


def test_a_pinned_attention_kernel_is_recorded_and_a_kernel_that_cannot_run_fails(tmp_path) -> None:
    """``--attention`` pins every pass to one backend: the report says which, and a backend the
    device lacks (cuDNN's on a CPU) fails the pass instead of falling back to another."""
    args = ["--device", "cpu", "--tiny", "--ctx", "16", "--batches", "1,2", "--draft-lengths", "0,2", "--contexts", "",
            "--prefill", "8,16"]
    out = tmp_path / "report.json"
    assert main([*args, "--attention", "math", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["attention"] == "math" and len(report["decode"]) == 4
    with pytest.raises(RuntimeError, match="No viable backend"):
        main([*args, "--attention", "cudnn"])


def test_packed_grouped_query_attention_decodes_as_the_unpacked_pass() -> None:
    torch.manual_seed(0)
    model = Model(replace(TINY, kv_heads=2), "cpu", torch.float32)
    model.prepare(3, 20, 1, 1 << 30)
    tokens = torch.randint(0, TINY.vocab, (3, 1))
    unpacked = model.forward(tokens)
    model.pack_gqa = True
    assert torch.equal(model.forward(tokens), unpacked)

"""The ``reasoning`` workload's shape, acceptance by draft source (live siblings, looping text),
and the closing lines of its comparison: cheap runs of a few workers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bubblespec.bench.pass_cost import faster_of, fit_context_profile, fit_profile
from bubblespec.bench.sim.__main__ import _parser, main, resolve
from bubblespec.bench.sim.costs import (
    CONTEXT_FITS,
    GPU_H100_7B,
    GPU_H100_7B_CONTEXT,
    GPU_H100_7B_GQA,
    GPU_H100_7B_GQA_DERIVED,
    CostProfile,
)
from bubblespec.bench.sim.engine import Member, SimulatedEngine
from bubblespec.bench.sim.reasoning import (REASONING_ACCEPTANCE, REASONING_LENGTHS, REASONING_SAMPLES,
                                            REASONING_WORKLOAD, SEER_ONE_PATH, SENSITIVITY, alpha_for_tau, shape)
from bubblespec.bench.sim.simulator import SimSettings, simulate
from bubblespec.bench.sim.workload import AcceptanceModel, LengthModel, Workload, expected_accepted

FLAT = CostProfile("flat", base_seconds=0.01, per_seq_seconds=0.0, per_draft_token_seconds=0.0,
                   prefill_per_token_seconds=0.0)

REPO = Path(__file__).resolve().parents[2]


def test_reasoning_lengths_have_the_published_shape() -> None:
    s = shape(REASONING_WORKLOAD, 0, 2, 256, REASONING_SAMPLES)
    assert s.requests == 2 * 256 * 16 and s.samples == 16 == REASONING_SAMPLES
    assert 0.02 <= s.truncated_share <= 0.045  # ~3% at a 16K cap (TailSieve, second-hand)
    assert 2.5 <= s.cap_over_mean <= 3.5  # Seer: 22,386 of 65,536 (2.9x)
    assert s.max_tokens == 16384 == REASONING_LENGTHS.max_tokens
    assert all(len(p.lengths) == 16 for p in REASONING_WORKLOAD.step(0, 0, 32, 16))


def test_alpha_for_tau_inverts_the_tokens_per_pass_formula() -> None:
    for tau in (1.70, 2.04, 2.53):
        a = alpha_for_tau(tau)
        assert (1 - a**9) / (1 - a) == pytest.approx(tau, abs=0.005)
    assert REASONING_ACCEPTANCE.suffix == alpha_for_tau(SEER_ONE_PATH[0]) == 0.412
    with pytest.raises(ValueError, match="tau"):
        alpha_for_tau(0.9)


def test_own_text_acceptance_rises_with_finished_siblings() -> None:
    acc = REASONING_ACCEPTANCE
    means = [acc.own_text_mean(n) for n in range(16)]
    assert means == sorted(means) and means[0] == acc.suffix
    assert means[1] == alpha_for_tau(2.04) and means[4] == means[1] and means[5] == alpha_for_tau(2.32)
    assert means[15] == alpha_for_tau(2.53)
    with pytest.raises(ValueError, match="siblings"):
        replace(acc, siblings=((5, 0.5), (1, 0.4)))
    with pytest.raises(ValueError, match="loop_share"):
        replace(acc, loop_share=1.5)


def test_an_engine_retunes_a_member_when_its_siblings_finish() -> None:
    e = SimulatedEngine("w", FLAT, AcceptanceModel(paying=False, max_draft_tokens=8))
    m = Member("r", 1000, suffix_alpha=0.41, best=True)
    e.add(0.0, m)
    t = e.commit(0.0)
    assert m.suffix_phase and m.rate == pytest.approx(1 + expected_accepted(0.41, m.k))
    before = m.rate
    e.retune(t / 2, m, 0.61)  # a row of the siblings table reached half way
    t2 = e.commit(t / 2)
    assert m.rate > before and t2 < t
    (done,) = e.due(t2)
    assert done.length == 1000 and done.suffix_accepted > 0


def test_looping_text_is_drafted_at_near_certain_acceptance() -> None:
    e = SimulatedEngine("w", FLAT, AcceptanceModel(paying=False, max_draft_tokens=8))
    m = Member("r", 4000, suffix_alpha=0.41, loop_from=1000.0, loop_alpha=0.99)
    e.add(0.0, m)
    t = e.commit(0.0)
    assert e.due(t) == [] and m.pos0 == pytest.approx(1000)  # the loop starts: a new phase
    e.commit(t)
    assert m.rate == pytest.approx(1 + expected_accepted(0.99, 8))


def small(acceptance: AcceptanceModel, policy: str = "queue", drafting: bool = True, profile: CostProfile = FLAT,
          workload: Workload = REASONING_WORKLOAD):
    return simulate(policy, 4, 512, 2, profile, drafting, 0, workload=workload, acceptance=acceptance,
                    settings=SimSettings(capacity=64, samples=16))


def test_live_siblings_raise_own_text_acceptance_in_a_run() -> None:
    quick = Workload(lengths=replace(REASONING_LENGTHS, median_tokens=400.0, max_tokens=1600))
    alone = small(replace(REASONING_ACCEPTANCE, siblings=()), workload=quick)
    grouped = small(REASONING_ACCEPTANCE, workload=quick)

    def own(r) -> float:  # accepted per drafted own-text token, over the reported steps
        stats = [x for s in r.reported for x in s.summary.provenance.sources if x.source == "suffix"]
        return sum(x.accepted_tokens for x in stats) / sum(x.drafted_tokens for x in stats)

    assert own(grouped) > own(alone)
    assert grouped.mean("forward_passes_per_token") < alone.mean("forward_passes_per_token")


def test_baseline_reports_its_tail_share_and_truncated_responses() -> None:
    r = small(REASONING_ACCEPTANCE, policy="static", drafting=False)
    for s, step in zip(r.steps, range(2)):
        lengths = [n for p in REASONING_WORKLOAD.step(0, step, 32, 16) for n in p.lengths]
        assert s.truncated == sum(n >= 16384 for n in lengths) > 0
        assert 0 < s.tail_share < 1


def test_short_workload_resolves_to_the_old_defaults_and_reasoning_to_the_context_fit() -> None:
    workload, acceptance, profile, _ = resolve(_parser().parse_args([]))
    assert workload == Workload(lengths=LengthModel()) and acceptance == AcceptanceModel() and profile is GPU_H100_7B
    args = _parser().parse_args(["--workload", "reasoning"])
    workload, acceptance, profile, note = resolve(args)
    assert workload == REASONING_WORKLOAD and acceptance == REASONING_ACCEPTANCE and args.samples == 16
    assert profile is GPU_H100_7B_CONTEXT is CONTEXT_FITS["gpu-h100-7b"] and "charges context" in note
    _, _, profile, _ = resolve(_parser().parse_args(["--workload", "reasoning", "--context-blind"]))
    assert profile is GPU_H100_7B
    with pytest.raises(SystemExit, match="loop_share"):
        resolve(_parser().parse_args(["--workload", "reasoning", "--loop-share", "2"]))
    with pytest.raises(SystemExit, match="--ceiling bounds the short workload"):
        main(["--workload", "reasoning", "--ceiling", "0"])


def test_sensitivity_rows_name_their_source_and_change_one_constant() -> None:
    for name, (what, low, high) in SENSITIVITY.items():
        assert what and set(low) == set(high) and len(low) == 1, name
        replace(REASONING_ACCEPTANCE, **low), replace(REASONING_ACCEPTANCE, **high)  # valid models


def test_reasoning_comparison_prints_the_tail_share(capsys) -> None:
    assert main(["--workload", "reasoning", "--workers", "4", "--requests", "256", "--max-tokens", "2048",
                 "--median-tokens", "500", "--policies", "queue+drafts"]) == 0
    out = capsys.readouterr().out
    assert "workload reasoning" in out and "queue+drafts" in out
    assert "4 workers, static (baseline): the last 10% of requests take" in out and "2048-token cap" in out


def test_the_derived_gqa_profile_is_the_context_fit_with_a_ninth_of_its_kv_read() -> None:
    g, c = GPU_H100_7B_GQA_DERIVED, GPU_H100_7B_CONTEXT
    assert g.per_context_token_seconds == pytest.approx(c.per_context_token_seconds * 0.109, rel=0.01)
    for name in ("base_seconds", "per_seq_seconds", "per_draft_token_seconds", "prefill_per_token_seconds",
                 "per_draft_context_token_seconds"):
        assert getattr(g, name) == getattr(c, name), name
    assert "not measured" in g.source


def test_the_gqa_profile_is_the_context_fit_of_the_faster_of_its_two_measured_layouts() -> None:
    def load(name: str) -> dict:
        return json.loads((REPO / "bench" / "measurements" / name).read_text())

    packed, expanded = load("h100-qwen25-7b-packed.json"), load("h100-qwen25-7b-expanded.json")
    assert packed["shape"] == expanded["shape"] and packed["shape"]["kv_heads"] == 4
    assert packed["pack_gqa"] is True and expanded.get("pack_gqa", False) is False
    report = faster_of([packed, expanded])
    assert report["context"] == load("h100-qwen25-7b.json")["context"]  # the committed fit input
    fit = fit_context_profile(report)
    for name in ("base_seconds", "per_seq_seconds", "per_context_token_seconds", "per_draft_token_seconds",
                 "per_draft_context_token_seconds"):
        assert getattr(GPU_H100_7B_GQA, name) == pytest.approx(fit[name], rel=5e-3), name
    assert GPU_H100_7B_GQA.prefill_per_token_seconds == pytest.approx(fit_profile(report)["prefill_per_token_seconds"],
                                                                      rel=5e-3)
    assert fit["median_rel_error"] < 0.04
    # each layout lost somewhere: the faster-of report is not either one alone
    assert report["context"] != packed["context"] and report["context"] != expanded["context"]
    # the KV read per token measured where the derived profile scaled it: within 2%
    assert GPU_H100_7B_GQA.per_context_token_seconds == pytest.approx(
        GPU_H100_7B_GQA_DERIVED.per_context_token_seconds, rel=0.02)


def test_the_context_profile_holds_at_contexts_past_its_fitted_sweep() -> None:
    """gpu-h100-7b-context was fitted up to 8,192 tokens; the reasoning workload runs to 16,896.
    A later report measured 16,384: without drafts within 6%, with them within 20%."""
    report = json.loads((REPO / "bench" / "measurements" / "h100-llama7b-mha-16k.json").read_text())
    far = [p for p in report["context"] if p["ctx"] == 16384]
    assert len(far) == 9
    for p in far:
        b, k, ctx = p["batch"], p["k"], p["ctx"]
        charged = GPU_H100_7B_CONTEXT.step_seconds(b, b * k, context_tokens=b * ctx, draft_context_tokens=b * k * ctx)
        assert p["seconds"] == pytest.approx(charged, rel=0.06 if k == 0 else 0.2), p


def test_history_across_epochs_is_a_what_if_draft_for_every_request() -> None:
    quick = Workload(lengths=replace(REASONING_LENGTHS, median_tokens=400.0, max_tokens=1600))
    first = small(REASONING_ACCEPTANCE, workload=quick)
    later = small(replace(REASONING_ACCEPTANCE, epoch_history=0.79), workload=quick)
    assert all(s.with_history_draft < s.requests for s in first.steps)  # only samples that start after a sibling
    assert all(s.with_history_draft == s.requests for s in later.steps)  # 0.79 beats every draft found
    assert later.mean("forward_passes_per_token") < first.mean("forward_passes_per_token")
    with pytest.raises(ValueError, match="epoch_history"):
        replace(REASONING_ACCEPTANCE, epoch_history=1.0)

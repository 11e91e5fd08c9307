"""The simulator's figures are exact to the last bit across its speed work: golden figures.

Each case below was simulated by the code before the simulator and the core's hot paths were
sped up (the engine's re-planning, the event loop, ``_fill`` / ``_next_for``, the step's
provenance total); every float is compared with ``==``, not approximately. A change to a
cost, a rounding or a summation order fails here. A change that is meant to move the figures
(a new model, a new scheduling rule) updates these values and says why.

Draft jobs beside requests (``CoreSettings.max_draft_jobs_beside_requests``, 2026-11-24) are a
new scheduling rule: the cases that came before it run without it (``BEFORE_BESIDE``), and
three of them still give their old figures to the bit. The fourth ("suffix, gap, tail") moved
in its second step by 0.007% (27.34283 -> 27.34101 s): dispatch now waits for the results of
the draft jobs a new step's arrival stopped (``_stop_arrived``). The case "queue+drafts,
beside requests" runs the rule at its default. Its figures moved when jobs beside requests
began in the first step (``CoreSettings.draft_beside_first_step``) and a placement came to plan
drafts once, after every request of it was placed: steps 38.62 / 57.17 / 35.41 s became
39.59 / 52.91 / 35.44 s (the first step pays for drafting the second beside its requests).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from bubblespec.bench.sim.costs import GPU_H100_7B, CostProfile
from bubblespec.bench.sim.simulator import SimSettings, simulate
from bubblespec.bench.sim.workload import AcceptanceModel
from bubblespec.client.types import Provenance, SourceStats
from bubblespec.scheduler.core.state import CoreSettings, _total

# The cpu-tiny calibration these figures were simulated with (2026-11-22), pinned here: the golden
# figures check the simulator's arithmetic, and a new calibration of CPU_TINY must not move them.
CPU_TINY_2026_11_22 = CostProfile("cpu-tiny-2026-11-22", 5.35e-3, 1.47e-4, 6.24e-5, 2.32e-5)

BEFORE_BESIDE = SimSettings(core=CoreSettings(max_draft_jobs_beside_requests=0))

CASES = {
    "queue+drafts": dict(policy="queue", workers=24, requests_per_step=1536, steps=3, profile=GPU_H100_7B,
                         drafting=True, settings=BEFORE_BESIDE),
    "queue+drafts, beside requests": dict(policy="queue", workers=24, requests_per_step=1536, steps=3,
                                          profile=GPU_H100_7B, drafting=True),
    "static": dict(policy="static", workers=24, requests_per_step=1536, steps=2, profile=GPU_H100_7B, drafting=False),
    "longest-first+drafts, fixed rule": dict(policy="longest-first", workers=12, requests_per_step=768, steps=3,
                                             profile=GPU_H100_7B, drafting=True, settings=BEFORE_BESIDE,
                                             acceptance=replace(AcceptanceModel(), paying=False, max_draft_tokens=8)),
    "queue+drafts, suffix, gap, tail": dict(policy="queue", workers=16, requests_per_step=1024, steps=3,
                                            profile=CPU_TINY_2026_11_22,
                                            drafting=True, acceptance=replace(AcceptanceModel(), suffix=0.5),
                                            settings=replace(BEFORE_BESIDE, train_seconds=5.0, tail_requests=2)),
}

# per step: makespan, forward passes, accepted, drafted, busy / idle / drafting worker-seconds,
# requests with a future draft, draft jobs started; then the events of the run
GOLDEN = {
    'queue+drafts': ([
        (38.624075, 908770, 0, 0, 571.6680499999999, 109.64525, 245.66449999999998, 0, 1085),
        (56.166733957553184, 445347, 483980, 1470209, 547.612184101922, 306.88522392222643, 493.5042069571278, 1536, 1393),
        (34.73950831330514, 396416, 522668, 1670434, 418.8999589651945, 131.91697224109515, 282.9312683130336, 1536, 1127),
    ], 8490),
    'static': ([
        (38.883875, 908770, 0, 0, 555.24405, 377.96895000000006, 0.0, 0, 0),
        (67.76494999999993, 929327, 0, 0, 777.1259749999989, 849.2328249999993, 0.0, 0, 0),
    ], 2979),
    'longest-first+drafts, fixed rule': ([
        (45.169250000000005, 475108, 0, 0, 330.0041, 48.861725000000035, 163.16517500000006, 0, 611),
        (57.990603063179805, 230236, 227587, 430340, 225.04773478579207, 189.279891800831, 281.55961017153453, 768, 711),
        (61.492772739033626, 234535, 239059, 450900, 286.56081560206593, 180.8241546220702, 270.52830264426734, 768, 719),
    ], 4531),
    'queue+drafts, suffix, gap, tail': ([
        (26.99590323750587, 368483, 241501, 619169, 257.4121478020938, 59.94619846531761, 114.57610553268255, 0, 609),
        (27.34100852286079, 269295, 344300, 735367, 237.84269080473206, 56.307534719026506, 143.30591084201407, 1024, 718),
        (35.4450877608717, 263651, 342356, 729203, 228.61150189950135, 133.42355253244006, 205.08634974200578, 1024, 842),
    ], 5599),
    'queue+drafts, beside requests': ([
        (39.591599999999964, 908770, 0, 0, 586.0605999999996, 0.0, 364.1377999999994, 0, 1325),
        (52.911423101184944, 432046, 497281, 1467179, 545.183268449857, 35.380538841716685, 689.3103471368651, 1536, 1427),
        (35.44307787265504, 403209, 515875, 1562793, 429.81367590064247, 0.0, 420.8201930430786, 1536, 1253),
    ], 8960),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_simulated_figures_are_unchanged_to_the_last_bit(name):
    kw = dict(CASES[name])
    r = simulate(kw.pop("policy"), kw.pop("workers"), kw.pop("requests_per_step"), kw.pop("steps"), kw.pop("profile"),
                 kw.pop("drafting"), 0, **kw)
    got = [(s.summary.makespan_seconds, s.summary.provenance.forward_passes, s.summary.provenance.accepted(),
            s.summary.provenance.drafted(), s.summary.busy_worker_seconds, s.summary.idle_worker_seconds,
            s.summary.drafting_worker_seconds, s.with_future_draft, s.draft_jobs) for s in r.steps]
    steps, events = GOLDEN[name]
    assert got == steps
    assert r.events == events


def test_step_provenance_total_is_the_sum_of_the_completions():
    provs = [Provenance(3), Provenance(5, (SourceStats("history", 4, 2),)),
             Provenance(7, (SourceStats("future", 10, 6), SourceStats("suffix", 3, 1))), Provenance(),
             Provenance(2, (SourceStats("future", 1, 0),))]
    assert _total(provs) == sum(provs, Provenance())
    assert _total([]) == sum([], Provenance()) == Provenance()

"""The simulator and the real benchmark agree on the makespan ordering of the four arms.

The real side is ``bubblespec bench``'s own code (``run_bench``) on the session's vLLM CPU
workers, over a long-tailed workload whose lengths the test sets (``ignore_eos`` with
per-prompt ``max_tokens``). The simulated side replays those very lengths
(``TraceWorkload``) on the scheduling core with the CPU cost profile, the same workers,
capacity, samples, draft length and trainer gap, and the draft acceptance the real run
measured. Where the simulator predicts a clear gap between two arms (>= 50%), the real
medians must put them in the same order; closer pairs are within this machine's noise and
are not judged. At least one pair must be judged, or the test would check nothing.
"""

from __future__ import annotations

import itertools
import random
import statistics

from bubblespec.cli.bench import BenchConfig, run_bench
from bubblespec.client import Prompt
from bubblespec.bench.sim.costs import CPU_TINY
from bubblespec.bench.sim.simulator import SimSettings, simulate
from bubblespec.bench.sim.workload import AcceptanceModel, TraceWorkload
from tests.factories import token_prompts

CLEAR_GAP = 1.5
UPDATE = 1e-5
"""Weight noise per step. The test model is random, so its logits are nearly flat and a 1e-3
update (the bench's, on a trained policy) rewrites much of its greedy output: future drafts
were accepted 56% of the time there, and at that rate the simulator, whose acceptance is
per token and independent, overstates what drafts buy (see docs/SIMULATOR.md). A trained
low-entropy policy keeps its outputs under such updates; 1e-5 does that for this model."""
STEPS, PROMPTS, SAMPLES, LONG, GAP = 4, 8, 2, 160, 1.5
ARMS = {"baseline": ("static", False), "queue": ("queue", False),
        "static+drafts": ("static", True), "bubblespec": ("queue", True)}


def _workload() -> tuple[list[list[Prompt]], list[tuple[int, ...]]]:
    """Per step: most responses 12-40 tokens, one LONG (the straggler), at a random place."""
    rng = random.Random(7)
    steps, lengths = [], []
    for s in range(STEPS + 1):  # + the last step's lookahead
        lens = [rng.randrange(12, 40) for _ in range(PROMPTS)]
        lens[rng.randrange(PROMPTS)] = LONG
        ids = token_prompts(PROMPTS, seed=900 + s)
        steps.append([Prompt(f"p{i}", token_ids=t, max_tokens=n) for i, (t, n) in enumerate(zip(ids, lens))])
        lengths.append(tuple(lens))
    return steps, lengths


async def test_simulator_and_benchmark_agree_on_the_order_of_the_arms(cluster, client, tiny_model):
    prompts, lengths = _workload()
    cfg = BenchConfig(steps=STEPS, prompts=PROMPTS, samples=SAMPLES, max_tokens=LONG, ignore_eos=True,
                      lookahead_steps=1, train_seconds=GAP, update_scale=UPDATE)
    try:
        report = await run_bench(cluster, prompts, tiny_model, cfg)
    finally:  # give the shared workers their original weights back
        await client.update_policy(cluster.scheduler.core.version + 1, tiny_model)
    rows = report["steps"]
    assert all(t["exact"] for t in report["summary"]), "a drafting arm changed a greedy result"
    for r in rows:  # the workload ran as set: every response had its prompt's length
        assert r["generated_tokens"] == SAMPLES * sum(lengths[r["step"] - 1])
    real = {arm: statistics.median(r["makespan_seconds"] for r in rows if r["arm"] == arm and r["step"] >= 2)
            for arm in ARMS}
    future = [r["by_source"]["future"] for r in rows if r["arm"] == "bubblespec" and "future" in r["by_source"]]
    accepted, drafted = sum(f["accepted"] for f in future), sum(f["drafted"] for f in future)
    assert drafted > 0, "the drafting arm drafted nothing from future drafts"
    alpha = min(0.95, max(0.05, accepted / drafted))

    settings = cluster.engine_settings
    trace = TraceWorkload(tuple(lengths), prompt_tokens=len(prompts[0][0].token_ids), max_tokens=LONG)
    accept = AcceptanceModel(future=alpha, history=alpha, max_draft_tokens=settings.num_speculative_tokens,
                             token_budget=settings.draft_token_budget)
    sim_settings = SimSettings(capacity=settings.max_num_seqs, samples=SAMPLES, train_seconds=GAP)
    simulated = {}
    for arm, (policy, drafts) in ARMS.items():
        r = simulate(policy, len(cluster.agents), PROMPTS * SAMPLES, STEPS, CPU_TINY, drafts, 0,
                     workload=trace, acceptance=accept, settings=sim_settings)
        simulated[arm] = statistics.median(s.summary.makespan_seconds for s in r.reported)

    judged = []
    for a, b in itertools.combinations(ARMS, 2):
        fast, slow = sorted((a, b), key=simulated.get)
        if simulated[slow] / simulated[fast] >= CLEAR_GAP:
            judged.append((fast, slow))
    print("simulated makespans", {k: round(v, 3) for k, v in simulated.items()},
          "real", {k: round(v, 3) for k, v in real.items()}, "future acceptance", round(alpha, 3))
    assert judged, f"the simulator sees no clear gap between any two arms: {simulated}"
    wrong = [(fast, slow) for fast, slow in judged if not real[fast] < real[slow]]
    assert not wrong, f"simulator and benchmark disagree on {wrong}: simulated {simulated}, real {real}"

"""The embedded demo: a two-step synchronous rollout through the SDK against ``up``.

Step 1 announces step 2's prompts as lookahead, so idle workers pre-generate drafts for them;
between the steps the trainer pushes new weights (a small perturbation stands in for a
gradient step); step 2's completions then report accepted ``future`` draft tokens.
"""

from __future__ import annotations

import random
import tempfile
import time

from bubblespec.client import AsyncRolloutClient, SamplingParams, StepSummary

__all__ = ["DEMO_MODEL_NOTE", "NUMBERS_EXPLAINED", "demo_prompts", "run_demo"]

DEMO_MODEL_NOTE = ("The demo model is a tiny, randomly initialised Llama (no download): its completions are "
                   "gibberish by design.\nThe point is the scheduling and that speculation stays exact, not the text.")

NUMBERS_EXPLAINED = """\
What the numbers mean:
  makespan  wall time of the step, from submit to its last completion
  fwd/tok   engine forward passes per generated token: 1.000 without drafts; below 1 when draft
            tokens were accepted (each accepted token is one forward pass saved)
  bubble    share of the workers' time during the step spent idle (the rollout bubble)
  accepted/drafted by source  draft tokens the engines accepted / proposed, by where the draft came
            from: future = pre-generated for this step's prompts while workers were idle in the
            step before (announced as lookahead), sibling = another sample of the same prompt
Drafts only save forward passes: every completion is token-for-token what the engine generates
without them (docs/EXACTNESS.md)."""


def demo_prompts(step: int, count: int) -> list[str]:
    rng = random.Random(step)
    return [" + ".join(str(rng.randrange(1, 99)) for _ in range(rng.randrange(2, 6))) + " =" for _ in range(count)]


def _row(s: StepSummary) -> str:
    by_source = ", ".join(f"{x.source} {x.accepted_tokens}/{x.drafted_tokens}" for x in s.provenance.sources) or "-"
    return (f"{s.step_id:>6} {s.makespan_seconds:8.2f}s {s.completions:5d} {s.generated_tokens:7d} "
            f"{s.forward_passes_per_token:8.3f} {100 * s.bubble_share:6.1f}%  {by_source}")


async def run_demo(cluster, prompts_per_step: int, samples: int, say=print) -> None:
    """Run the two steps, telling ``say`` what happens; end with the table and its legend."""
    from bubblespec.bench.tiny_model import perturb_weights

    sampling = SamplingParams(temperature=0.0, max_tokens=192)
    steps = [demo_prompts(1, prompts_per_step), demo_prompts(2, prompts_per_step)]
    rows = []
    async with AsyncRolloutClient(cluster.target) as client:
        with tempfile.TemporaryDirectory() as tmp:
            for i, prompts in enumerate(steps, start=1):
                version = i - 1
                if i > 1:
                    path = perturb_weights(cluster.engine_settings.model, f"{tmp}/v{version}", scale=0.002, seed=version)
                    t = time.monotonic()
                    n = await client.update_policy(version, str(path))
                    say(f"policy v{version} (a small weight perturbation standing in for a training step) "
                        f"loaded on {n} workers in {time.monotonic() - t:.2f}s")
                lookahead = steps[i] if i < len(steps) else []
                say(f"step {i}: {len(prompts)} prompts x {samples} samples, greedy"
                    + (f"; announces step {i + 1}'s prompts as lookahead" if lookahead else ""))
                t = time.monotonic()
                result = await client.generate(f"demo-{i}", prompts, sampling, n=samples, policy_version=version,
                                               lookahead=lookahead)
                say(f"step {i}: {len(result.completions)} completions in {time.monotonic() - t:.2f}s; "
                    f"first: {prompts[0]!r} -> {result.completions[0].text[:40]!r}")
                rows.append(_row(result.summary))
    say("\n  step makespan compl. tokens fwd/tok bubble  accepted/drafted by source")
    say("\n".join(rows))
    say()
    say(NUMBERS_EXPLAINED)

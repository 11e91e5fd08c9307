"""One worker's share of a bench step with stale drafts, on one vLLM CPU engine, with and
without draft jobs beside it (``python -m bubblespec.bench.stale_step``).

``stale_tail`` runs a step's longest response alone; this runs the whole batch a worker gets in
``bubblespec bench`` (the 32 prompts of one bench step, greedy, the bench's engine settings: 32
speculative tokens, the set draft token cost, the makespan plan) on one engine bound to
``--core``, so that the rest of the bench (its other engine, its control process, the
scheduler's timing) is left out. The drafts are the responses under weights ``--versions`` of the
bench's updates older (``perturb_weights``, as ``stale_tail`` makes them). Arms, in alternating
order over ``--rounds``: no drafts; the stale drafts; each of those with ``--jobs`` draft jobs
beside the batch (the longest prompts of the next two steps, one job after another in each
slot, each prompt once and none with a draft, stopped when the batch's last response ends:
what ``max_draft_jobs_beside_requests`` keeps beside a busy worker's requests). Prints each
arm's batch time (median over rounds) and its ratio to no drafts; any response that differs
from the response without drafts ends the run (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bubblespec.client import SamplingParams
from bubblespec.worker.engine import EngineOutput, EngineRequest, EngineSettings, VllmEngine


async def generate(engine: VllmEngine, request: EngineRequest) -> EngineOutput:
    final = None
    async for out in engine.generate(request):
        final = out
    assert final is not None
    return final


async def keep_drafting(engine: VllmEngine, tag: str, prompts: list[tuple[int, ...]], sp: SamplingParams) -> None:
    """Draft jobs for ``prompts``, one after another (each prompt once: a job that found a draft
    of its own prompt would verify it many tokens a pass), until cancelled."""
    for n, prompt in enumerate(prompts):
        await generate(engine, EngineRequest(f"{tag}-{n}", prompt, sp, (), True, draft_job=True))


async def run_batch(engine: VllmEngine, tag: str, prompts: list[tuple[int, ...]], sp: SamplingParams,
                    drafts: list[tuple[int, ...]] | None,
                    jobs: list[list[tuple[int, ...]]]) -> tuple[float, list[tuple[int, ...]]]:
    """Seconds until the batch's last response ended, and the responses; ``jobs``: the prompts
    each job slot beside the batch drafts, in turn."""
    t0 = time.perf_counter()
    beside = [asyncio.create_task(keep_drafting(engine, f"{tag}-job{j}", ps, sp)) for j, ps in enumerate(jobs)]
    try:
        outs = await asyncio.gather(*(
            generate(engine, EngineRequest(f"{tag}-{i}", p, sp, (("future", drafts[i]),) if drafts else (), drafts is not None))
            for i, p in enumerate(prompts)))
        seconds = time.perf_counter() - t0
    finally:
        for task in beside:
            task.cancel()
        await asyncio.gather(*beside, return_exceptions=True)
    return seconds, [tuple(o.token_ids) for o in outs]


async def run(args: argparse.Namespace) -> int:
    from bubblespec.bench.rlvr import encode, make_prompts
    from bubblespec.bench.sim.costs import CPU_TINY
    from bubblespec.bench.tiny_model import perturb_weights
    from bubblespec.cli.bench import RLVR_MODEL_DIR, workload_model

    model = await workload_model(print, RLVR_MODEL_DIR)
    engine = VllmEngine(EngineSettings(model=model, max_model_len=1024, max_num_seqs=64, num_speculative_tokens=32,
                                       cpu_cores=args.core, draft_token_seconds=CPU_TINY.per_draft_token_seconds,
                                       measure_draft_cost=False))
    await engine.start()
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = [tuple(encode(p)) for p in make_prompts(32, seed=args.seed * 1000 + args.step)]
    # the next two steps' prompts, longest first (jobs that run through the step), dealt to the job slots
    later = sorted((tuple(encode(p)) for s in (1, 2) for p in make_prompts(32, seed=args.seed * 1000 + args.step + s)),
                   key=len, reverse=True)
    jobs = [later[j::args.jobs] for j in range(args.jobs)]
    times: dict[str, list[float]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bubblespec-stale-step-") as tmp:
            _, old = await run_batch(engine, "old", prompts, sp, None, [])
            current = model
            for v in range(args.versions):
                current = str(perturb_weights(current, Path(tmp) / f"w{v}", scale=args.update_scale, seed=args.seed + v))
            await engine.load_weights(current)
            _, new = await run_batch(engine, "new", prompts, sp, None, [])
            i = max(range(len(new)), key=lambda j: len(new[j]))
            same = next((n for n, (a, b) in enumerate(zip(old[i], new[i], strict=False)) if a != b),
                        min(len(old[i]), len(new[i])))
            print(f"{len(prompts)} responses, {sum(map(len, new))} tokens; the longest {len(new[i])} tokens, its stale "
                  f"draft the same for the first {same}")
            arms = {"none": (None, []), "stale": (old, []), f"none+{args.jobs} jobs": (None, jobs),
                    f"stale+{args.jobs} jobs": (old, jobs)}
            for r in range(args.rounds):
                for name in list(arms) if r % 2 == 0 else list(reversed(arms)):
                    await engine.control("reset_prefix_cache", {})
                    seconds, got = await run_batch(engine, f"r{r}-{name}", prompts, sp, *arms[name])
                    if got != new:
                        print(f"NOT EXACT: arm {name}, round {r + 1}")
                        return 1
                    times.setdefault(name, []).append(seconds)
    finally:
        await engine.shutdown()
    base = statistics.median(times["none"])
    for name, ts in times.items():
        print(f"{name:>16}: {statistics.median(ts):.3f} s ({base / statistics.median(ts):.2f}x no drafts; "
              f"median of {len(ts)}: {', '.join(f'{t:.3f}' for t in ts)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step", type=int, default=4, help="which bench step's prompts (0-based, seed 0's workload)")
    p.add_argument("--versions", type=int, default=2, help="policy versions between the drafts and the step")
    p.add_argument("--jobs", type=int, default=4, help="draft jobs beside the batch in the arms with jobs")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=480)
    p.add_argument("--update-scale", type=float, default=3e-5)
    p.add_argument("--core", default="1", help="the core the engine runs on")
    p.add_argument("--seed", type=int, default=0)
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

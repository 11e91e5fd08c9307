"""A step's tail with a stale draft, on one vLLM CPU engine (``python -m bubblespec.bench.stale_tail``).

In the real bench with drafting in bubbles only (``bubblespec bench --train-seconds 0``), a step
whose longest response's ``future`` draft parts from it part-way can run slower than the
baseline: what is left after the parting is decoded about a token a pass, each pass verifying
drafts that are rejected. This isolates that tail. The bench's RLVR model and engine settings
(32 speculative tokens, the set draft token cost unless ``--draft-token-seconds 0``); the
prompts of one bench step; drafts made ``--versions`` policy versions before (the bench's weight
noise, ``perturb_weights``). For the ``--longest`` prompts whose responses are longest under the
current weights, each alone on the engine (a step's last request), in alternating order over
``--rounds``: no drafts, the stale draft (what the bench's step has), and the response itself
as its draft (a fresh one). Prints, per prompt and arm, the medians over the rounds of the wall
time (and its ratio to no drafts), the passes and ms a pass, and the first round's accepted and
drafted tokens; any output that differs from the response without drafts ends the run (exit 1).
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
from bubblespec.worker.engine import EngineRequest, EngineSettings, VllmEngine


async def generate(engine: VllmEngine, key: str, prompt: tuple[int, ...], sp: SamplingParams,
                   drafts: tuple[tuple[str, tuple[int, ...]], ...] = (), use_drafts: bool = True) -> dict:
    t0 = time.perf_counter()
    final = None
    async for out in engine.generate(EngineRequest(key, prompt, sp, drafts, use_drafts)):
        final = out
    seconds = time.perf_counter() - t0
    assert final is not None
    drafted = sum(s.drafted_tokens for s in final.provenance.sources)
    accepted = sum(s.accepted_tokens for s in final.provenance.sources)
    return {"tokens": tuple(final.token_ids), "seconds": seconds, "passes": final.provenance.forward_passes,
            "drafted": drafted, "accepted": accepted}


async def run(args) -> int:
    from bubblespec.bench.rlvr import encode, make_prompts
    from bubblespec.bench.sim.costs import CPU_TINY
    from bubblespec.bench.tiny_model import perturb_weights
    from bubblespec.cli.bench import RLVR_MODEL_DIR, workload_model

    model = await workload_model(print, RLVR_MODEL_DIR)
    cost = CPU_TINY.per_draft_token_seconds if args.draft_token_seconds < 0 else args.draft_token_seconds
    engine = VllmEngine(EngineSettings(model=model, max_model_len=1024, max_num_seqs=64,
                                       num_speculative_tokens=args.num_speculative_tokens,
                                       draft_token_seconds=cost, measure_draft_cost=cost == 0))
    await engine.start()
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = [tuple(encode(p)) for p in make_prompts(32, seed=args.seed * 1000 + args.step)]
    try:
        with tempfile.TemporaryDirectory(prefix="bubblespec-stale-tail-") as tmp:
            old = await asyncio.gather(*(generate(engine, f"old-{i}", p, sp, use_drafts=False)
                                         for i, p in enumerate(prompts)))
            current = model
            for v in range(args.versions):
                current = str(perturb_weights(current, Path(tmp) / f"w{v}", scale=args.update_scale, seed=args.seed + v))
            await engine.load_weights(current)
            new = await asyncio.gather(*(generate(engine, f"new-{i}", p, sp, use_drafts=False)
                                         for i, p in enumerate(prompts)))
            order = sorted(range(len(prompts)), key=lambda i: -len(new[i]["tokens"]))[: args.longest]
            for i in order:
                same = next((n for n, (a, b) in enumerate(zip(old[i]["tokens"], new[i]["tokens"], strict=False)) if a != b),
                            min(len(old[i]["tokens"]), len(new[i]["tokens"])))
                print(f"prompt {i}: {len(new[i]['tokens'])} tokens now, the stale draft {len(old[i]['tokens'])} tokens, "
                      f"the same for the first {same}")
            arms = {"none": lambda i: ((), False), "stale": lambda i: ((("future", old[i]["tokens"]),), True),
                    "fresh": lambda i: ((("future", new[i]["tokens"]),), True)}
            rows: dict[str, list[dict]] = {a: [] for a in arms}
            for r in range(args.rounds):
                names = list(arms) if r % 2 == 0 else list(reversed(arms))
                for i in order:
                    for name in names:
                        drafts, use = arms[name](i)
                        await engine.control("reset_prefix_cache", {})
                        row = await generate(engine, f"r{r}-{name}-{i}", prompts[i], sp, drafts, use)
                        if row["tokens"] != new[i]["tokens"]:
                            print(f"NOT EXACT: prompt {i}, arm {name}, round {r + 1}")
                            return 1
                        rows[name].append({**row, "prompt": i})
    finally:
        await engine.shutdown()
    for i in order:
        base = statistics.median(r["seconds"] for r in rows["none"] if r["prompt"] == i)
        for name, all_rows in rows.items():
            rs = [r for r in all_rows if r["prompt"] == i]
            sec = statistics.median(r["seconds"] for r in rs)
            passes = statistics.median(r["passes"] for r in rs)
            ms = statistics.median(1000 * r["seconds"] / r["passes"] for r in rs)
            print(f"prompt {i} {name:>6}: {sec:.3f} s ({base / sec:.2f}x no drafts), {passes:.0f} passes, "
                  f"{ms:.2f} ms a pass, accepted {rs[0]['accepted']} of {rs[0]['drafted']} drafted "
                  f"(medians over {len(rs)} rounds; drafts of the first)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step", type=int, default=3, help="which bench step's prompts (0-based, seed 0's workload)")
    p.add_argument("--versions", type=int, default=2, help="policy versions between the draft and the step")
    p.add_argument("--longest", type=int, default=3, help="the prompts with the longest responses, each alone")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=480)
    p.add_argument("--num-speculative-tokens", type=int, default=32)
    p.add_argument("--draft-token-seconds", type=float, default=-1.0,
                   help="-1: the bench's set cost (CPU_TINY); 0: measured by the engine")
    p.add_argument("--update-scale", type=float, default=3e-5)
    p.add_argument("--seed", type=int, default=0)
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

"""Grouped drafts on one vLLM CPU engine with sampled samples: what a prompt's samples at
temperature 1 gain from each other (``python -m bubblespec.bench.group_drafts``).

The bench (``bubblespec bench``) decodes greedily, so a prompt's samples are one text and
grouped drafts have nothing to choose between. Here each of ``--prompts`` prompts of the bench's
RLVR task (its trained model, ``bench/rlvr.py``; ``--min-terms`` terms or more, for answers of
a few hundred tokens; fresh prompts every round, the same for both arms of a round, the
engine's kept samples and prefix cache dropped before each arm) is sampled ``--samples`` times at
``--temperature``, each sample with its own seed, all sent together; the only drafts are what
the engine's proposer finds in the group (running and finished samples, and with
``--self-suffix`` the sample's own text): no stored drafts. Two arms on the same engine, in
alternating order over ``--rounds``: drafts off (``use_drafts=False``), drafts on. Each prints
its forward passes per token, accepted draft tokens by source, and the wall time of the round;
the closing line gives the medians and their ratios.

Sampled outputs with drafts are not the same tokens as without (vLLM's rejection sampler draws
differently): that they have the same distribution is ``tests/support/exactness_ks.py``'s
business. This measures speed only.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from bubblespec.client import SamplingParams
from bubblespec.worker.engine import EngineRequest, EngineSettings, VllmEngine


async def one_round(engine: VllmEngine, prompts: list[tuple[int, ...]], samples: int, sp: SamplingParams,
                    drafts_on: bool, tag: str) -> dict:
    async def one(p: int, s: int):
        params = SamplingParams(temperature=sp.temperature, max_tokens=sp.max_tokens, seed=1000 * p + s + 1)
        req = EngineRequest(f"{tag}-{p}-{s}", prompts[p], params, (), drafts_on)
        final = None
        async for out in engine.generate(req):
            final = out
        return final

    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    outs = await asyncio.gather(*(one(p, s) for p in range(len(prompts)) for s in range(samples)))
    seconds = time.perf_counter() - t0
    cpu = [b - a for a, b in zip(cpu0, _cpu_seconds(), strict=True)]
    tokens = sum(len(o.token_ids) for o in outs)
    passes = sum(o.provenance.forward_passes for o in outs)
    by_source: dict[str, list[int]] = {}
    for o in outs:
        for src in o.provenance.sources:
            acc = by_source.setdefault(src.source, [0, 0])
            acc[0] += src.drafted_tokens
            acc[1] += src.accepted_tokens
    return {"seconds": seconds, "tokens": tokens, "passes": passes, "by_source": by_source, "cpu": cpu}


def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds used so far by this process (the client and ``VllmEngine``'s side) and by
    its child processes (vLLM's engine core, where the proposer runs)."""
    import psutil

    me = psutil.Process()
    children = 0.0
    for child in me.children(recursive=True):
        try:
            t = child.cpu_times()
            children += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    t = me.cpu_times()
    return t.user + t.system, children


async def run(args) -> int:
    from bubblespec.bench.rlvr import TaskSettings, encode, make_prompts
    from bubblespec.cli.bench import RLVR_MODEL_DIR, workload_model

    model = await workload_model(print, RLVR_MODEL_DIR)
    task = TaskSettings(min_terms=args.min_terms, max_terms=max(args.min_terms, TaskSettings.max_terms))

    def prompts_of(r: int) -> list[tuple[int, ...]]:  # fresh each round, the same for both arms of a round
        return [tuple(encode(p)) for p in make_prompts(args.prompts, seed=args.seed * 1000 + r, settings=task)]

    engine = VllmEngine(EngineSettings(model=model, max_model_len=1024, max_num_seqs=args.prompts * args.samples,
                                       num_speculative_tokens=args.num_speculative_tokens,
                                       self_suffix_drafting=args.self_suffix))
    await engine.start()
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    rows: dict[bool, list[dict]] = {False: [], True: []}
    try:
        await one_round(engine, prompts_of(-1)[:1], 2, sp, True, "warm")
        for r in range(args.rounds):
            for on in [a for a in ((False, True) if r % 2 == 0 else (True, False)) if args.only in ("", "on" if a else "off")]:
                # the other arm's finished samples must not be this one's drafts, nor its KV this one's prefix hits
                await engine.control("reset_prefix_cache", {})
                before = await engine.draft_cost()
                row = await one_round(engine, prompts_of(r), args.samples, sp, on, f"r{r}-{int(on)}")
                after = await engine.draft_cost()
                rows[on].append(row)
                drafted = after.get("drafted_proposals", 0) - before.get("drafted_proposals", 0)
                steps = after.get("proposals", 0) - before.get("proposals", 0)
                skipped = after.get("skipped_proposals", 0) - before.get("skipped_proposals", 0)
                src = ", ".join(f"{s} {a}/{d}" for s, (d, a) in sorted(row["by_source"].items())) or "-"
                print(f"round {r + 1} drafts {'on ' if on else 'off'}: {row['seconds']:6.2f} s, {row['tokens']} tokens, "
                      f"{row['passes'] / row['tokens']:.3f} passes a token, {drafted} of {steps} engine steps drafted "
                      f"({skipped} without a search); CPU s here / engine {row['cpu'][0]:.1f} / {row['cpu'][1]:.1f}; "
                      f"accepted/drafted by source: {src}")
        cost = await engine.draft_cost()
    finally:
        await engine.shutdown()
    if args.only:
        return 0
    off_s = statistics.median(r["seconds"] for r in rows[False])
    on_s = statistics.median(r["seconds"] for r in rows[True])
    off_p = statistics.median(r["passes"] / r["tokens"] for r in rows[False])
    on_p = statistics.median(r["passes"] / r["tokens"] for r in rows[True])
    paired = statistics.median(off["seconds"] / on["seconds"] for off, on in zip(rows[False], rows[True], strict=True))
    rate = statistics.median((on["tokens"] / on["seconds"]) / (off["tokens"] / off["seconds"])
                             for off, on in zip(rows[False], rows[True], strict=True))
    print(f"{args.prompts} prompts x {args.samples} samples at temperature {args.temperature:g}, up to "
          f"{args.max_tokens} tokens, {args.rounds} rounds: drafts off {off_s:.2f} s, {off_p:.3f} passes a token; "
          f"on {on_s:.2f} s ({off_s / on_s:.2f}x), {on_p:.3f} passes a token ({on_p / off_p:.2f}x) (medians); "
          f"by round (same prompts): time {paired:.2f}x, tokens/s {rate:.2f}x (medians)")
    print(f"the engine's draft costs at the end ({cost.get('source')}, {cost.get('steps')} clean passes): "
          f"{cost.get('draft_token_seconds', 0) * 1e6:.1f} us a draft token, "
          f"{cost.get('drafted_request_seconds', 0) * 1e6:.1f} us a drafted request, "
          f"{cost.get('spec_seconds', 0) * 1e3:.2f} ms a pass with any draft")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=16, help="samples per prompt (one group each)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4, help="rounds of both arms, their order alternating")
    p.add_argument("--num-speculative-tokens", type=int, default=8)
    p.add_argument("--self-suffix", action="store_true", help="also draft from each sample's own text")
    p.add_argument("--min-terms", type=int, default=20, help="fewest terms in a prompt (longer answers)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--only", choices=("on", "off"), default="", help="run one arm only (to profile it)")
    args = p.parse_args(argv)
    for name in ("prompts", "samples", "max_tokens", "rounds", "num_speculative_tokens", "min_terms"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())

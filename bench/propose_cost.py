"""What the draft proposer costs an engine pass, on a fake runner shaped like a bench step
(``python -m bubblespec.bench.propose_cost``).

``BubbleSpecProposer.propose`` runs on the engine's CPU between two passes, so every
microsecond it takes is a microsecond of every pass. The workload is one synchronous RL step
as ``bubblespec bench`` runs it on one worker, bubbles only: ``--prompts`` prompts x
``--samples`` greedy samples (the samples of a prompt are the same response, in step), each
response with a ``future`` draft one policy version old that holds for its first part and then
parts from it (``--parted`` of them), plus ``--jobs`` draft jobs beside the requests, each
continuing its own partial draft and then generating past it. Every pass accepts what the
response and the proposed draft agree on, plus the bonus token, as vLLM's verification does
under greedy decoding; the batch shrinks as responses end. It prints the proposer's median
microseconds a pass and its total per step, with the group index's small-update path (the
code as it is) and with every update through the vectorised path (``GroupIndex.SMALL_FLUSH``
0), side by side, and checks that both proposed the same drafts at every pass.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

from bubblespec.bench import rlvr
from bubblespec.worker import group_index
from bubblespec.worker.proposer import BubbleSpecProposer


def make_workload(prompts: int, samples: int, jobs: int, parted: float, seed: int) -> list[dict]:
    """Each row's prompt, response, draft and whether it is a draft job, in the bench's own task
    (``bench/rlvr.py``: its prompts, reference responses and character tokens): text whose
    3-grams recur many times in every response, as the group index meets it in the bench."""
    rng = random.Random(seed)
    rows = []
    for text in rlvr.make_prompts(prompts + jobs, seed=seed):
        job = len(rows) >= prompts * samples
        answer = np.array(rlvr.encode(rlvr.target(text)), dtype=np.int64)
        draft = answer
        terms = rlvr.parse_prompt(text)
        if job:  # a stopped job's partial draft: the first part of its own response
            draft = answer[: len(answer) // 4]
        elif rng.random() < parted:  # one version old: one step's term read wrong, every sum after it differs
            j = rng.randrange(1, len(terms))
            terms[j] = terms[j] % 9 + 1
            wrong = "+".join(f"{rlvr.LABELS[i]}{t}" for i, t in enumerate(terms)) + "="
            draft = np.array(rlvr.encode(rlvr.target(wrong)), dtype=np.int64)
        prompt = rlvr.encode(text)
        for _ in range(1 if job else samples):
            rows.append({"prompt": prompt, "answer": answer, "draft": draft, "job": job})
    return rows


class FakeRunner:
    """The parts of vLLM's model runner the proposer reads, for ``rows``."""

    def __init__(self, rows: list[dict], k: int, draft_token_seconds: float, pass_seconds: float):
        config = SimpleNamespace(
            additional_config={"bubblespec": {"cpu_sampler_fix": False, "draft_token_seconds": draft_token_seconds,
                                              "makespan": True}},
            speculative_config=SimpleNamespace(num_speculative_tokens=k),
            model_config=SimpleNamespace(get_vocab_size=lambda: 1 << 20),
            device_config=SimpleNamespace(device=SimpleNamespace(type="cpu")))
        self.proposer = BubbleSpecProposer(config)
        self.now = 0.0
        self.proposer.clock = lambda: self.now  # a pass's modelled time, for the rate the paying rule reads
        self.pass_seconds, self.cost = pass_seconds, draft_token_seconds
        self.rows = {f"r{i}": r for i, r in enumerate(rows)}  # by vLLM request id
        requests = {}
        for i, r in enumerate(rows):
            extra = {"key": f"k{i}", "drafts": [["future", r["draft"].astype("<u4").tobytes()]],
                     "predicted": float(len(r["answer"])), "job": r["job"]}
            requests[f"r{i}"] = SimpleNamespace(prompt_token_ids=r["prompt"],
                                                sampling_params=SimpleNamespace(extra_args={"bubblespec": extra}))
        self.live = list(requests)
        self.batch = SimpleNamespace(req_ids=list(self.live))
        self.proposer.attach(SimpleNamespace(input_batch=self.batch, requests=requests, execute_model=lambda: None))
        self.generated = {rid: 0 for rid in self.live}
        self.drafts: dict[str, list[int]] = {rid: [] for rid in self.live}

    def step(self) -> tuple[float, list[list[int]]] | None:
        """One pass: verify the last drafts, then time ``propose``; None once every row ended."""
        if not self.live:
            return None
        self.now += self.pass_seconds + self.cost * sum(map(len, self.drafts.values()))
        sampled = []
        for rid in self.live:
            answer, g, draft = self.rows[rid]["answer"], self.generated[rid], self.drafts[rid]
            agree = 0
            while agree < len(draft) and g + agree < len(answer) and draft[agree] == answer[g + agree]:
                agree += 1
            take = min(agree + 1, len(answer) - g)
            sampled.append(answer[g:g + take].tolist())
            self.generated[rid] = g + take
        width = max(len(self.rows[r]["prompt"]) + self.generated[r] for r in self.live)
        token_ids = np.zeros((len(self.live), width), dtype=np.int64)
        lengths = np.zeros(len(self.live), dtype=np.int64)
        for i, rid in enumerate(self.live):
            row = self.rows[rid]
            p, g = len(row["prompt"]), self.generated[rid]
            token_ids[i, :p] = row["prompt"]
            token_ids[i, p:p + g] = row["answer"][:g]
            lengths[i] = p + g
        self.batch.req_ids = list(self.live)
        t0 = time.perf_counter()
        drafts = self.proposer.propose(sampled, lengths, token_ids)
        seconds = time.perf_counter() - t0
        for rid, d in zip(self.live, drafts, strict=True):
            self.drafts[rid] = d
        # rows whose response ended leave the batch before the next pass
        self.live = [r for r in self.live if self.generated[r] < len(self.rows[r]["answer"])]
        self.drafts = {r: self.drafts[r] for r in self.live}
        return seconds, drafts


def run_step(rows: list[dict], small_flush: int, args: argparse.Namespace) -> tuple[list[float], list]:
    saved = group_index.GroupIndex.SMALL_FLUSH
    group_index.GroupIndex.SMALL_FLUSH = small_flush
    try:
        runner = FakeRunner(rows, args.k, args.draft_token_seconds, args.pass_seconds)
        times, proposed = [], []
        while (out := runner.step()) is not None:
            times.append(out[0])
            proposed.append(out[1])
        return times, proposed
    finally:
        group_index.GroupIndex.SMALL_FLUSH = saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16, help="prompts of the step on this worker")
    p.add_argument("--samples", type=int, default=2, help="greedy samples per prompt")
    p.add_argument("--jobs", type=int, default=4, help="draft jobs beside the requests")
    p.add_argument("--parted", type=float, default=0.5, help="share of responses whose draft parts from them")
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    p.add_argument("--draft-token-seconds", type=float, default=3e-5)
    p.add_argument("--pass-seconds", type=float, default=4e-3, help="a pass without drafts, for the rate")
    p.add_argument("--steps", type=int, default=5, help="steps (seeds) run with each path, alternating")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"{args.prompts} prompts x {args.samples} greedy samples + {args.jobs} draft jobs on one worker, "
          f"{args.parted:.0%} of the drafts part from their response, k={args.k}")
    print(f"{'step':>4} {'passes':>6} {'small us/pass':>13} {'vector us/pass':>14} {'ratio':>6} "
          f"{'small ms/step':>13} {'vector ms/step':>14} {'same drafts':>11}")
    ratios, totals = [], []
    for s in range(args.steps):
        rows = make_workload(args.prompts, args.samples, args.jobs, args.parted, args.seed + s)
        small, drafts_small = run_step(rows, group_index.GroupIndex.SMALL_FLUSH, args)
        vector, drafts_vector = run_step(rows, 0, args)
        same = drafts_small == drafts_vector
        a, b = statistics.median(small), statistics.median(vector)
        ratios.append(b / a)
        totals.append(sum(vector) / sum(small))
        print(f"{s + 1:>4} {len(small):>6} {a * 1e6:>13.0f} {b * 1e6:>14.0f} {b / a:>5.2f}x "
              f"{sum(small) * 1e3:>13.1f} {sum(vector) * 1e3:>14.1f} {str(same):>11}")
        if not same:
            print("the two paths proposed different drafts: a bug", file=sys.stderr)
            return 1
    print(f"median over steps: the small-update path takes the proposer {statistics.median(ratios):.2f}x "
          f"as fast a pass, {statistics.median(totals):.2f}x over the step")
    return 0


if __name__ == "__main__":
    sys.exit(main())

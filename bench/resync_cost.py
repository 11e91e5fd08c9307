"""What finding a sample's place in its group's texts costs, per-text scan against the group's
index, side by side (``python -m bubblespec.bench.resync_cost``).

A running sample whose draft was rejected searches its group's texts for where its last tokens
occurred (``RequestDrafter``'s resync) once per rejected draft, on the engine's CPU between two
passes. Until the group index (``worker/group_index.py``), each sample scanned every text one by
one: ``scan_resync`` below is that rule (the longest suffix of up to 3 tokens found in any text,
the occurrence nearest the sample's position), kept here as the baseline. ``GroupIndex.find``
looks the last tokens up in the group's n-gram map instead.

The workload: a group of ``--samples`` samples of ``--length`` tokens each, all halfway through
(the running ones) plus as many finished ones; each text is a base text with ``--mutate`` of its
tokens resampled, over a ``--vocab``-token vocabulary, so that siblings share most of their
text, as samples of one prompt do. Every running sample resyncs at its position twice: once
just after a token no text has at that place (a rejected draft: what the cost is measured on),
and once on its own text so far, where the script checks whether each rule's next token is
the sample's own next one (``hits``: the first draft token's chance of acceptance in this
model, where the base text is the likeliest continuation). It prints the median microseconds
per resync of both rules, their ratio, both rules' hits, and the index's memory per indexed
token (``tracemalloc``: the tables and the texts' own int64 tokens).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc

import numpy as np

from bubblespec.worker.group_index import GroupIndex


def scan_resync(texts: list[np.ndarray], generated: np.ndarray, match_len: int = 3) -> tuple[int, int] | None:
    """The per-text rule the group index replaced: a text that agrees with everything so far,
    else the longest suffix (up to ``match_len`` tokens) of ``generated`` found in any text
    before its last token, the occurrence nearest ``len(generated)``."""
    g = len(generated)
    for idx, tokens in enumerate(texts):
        if len(tokens) > g and np.array_equal(tokens[:g], generated):
            return idx, g
    tail = generated[g - min(match_len, g):]
    m = len(tail)
    best: tuple[int, int, int, int] | None = None
    for idx, tokens in enumerate(texts):
        ends = np.flatnonzero(tokens[:-1] == tail[-1])
        if len(ends) == 0:
            continue
        length = np.ones(len(ends), dtype=np.int64)
        agree = np.ones(len(ends), dtype=bool)
        for j in range(1, m):
            back = ends - j
            agree &= back >= 0
            agree[agree] = tokens[back[agree]] == tail[-1 - j]
            length += agree
        top = int(length.max())
        after = ends[length == top] + 1
        j = int(np.argmin(np.abs(after - g)))
        key = (-top, int(abs(after[j] - g)), idx, int(after[j]))
        if best is None or key[:2] < best[:2]:
            best = key
    return None if best is None else (best[2], best[3])


def make_group(samples: int, length: int, vocab: int, mutate: float, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, vocab, length)
    texts = []
    for _ in range(2 * samples):
        t = base.copy()
        hit = rng.random(length) < mutate
        t[hit] = rng.integers(0, vocab, int(hit.sum()))
        texts.append(t)
    return texts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=16, help="running samples of the group (as many finished)")
    p.add_argument("--length", default="1024,4096,16384", help="tokens per text (comma-separated: one run each)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--mutate", type=float, default=0.2, help="share of each text's tokens resampled")
    p.add_argument("--repeat", type=int, default=5, help="times each resync is timed (the median counts)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"group of {args.samples} running + {args.samples} finished samples, vocabulary {args.vocab}, "
          f"{args.mutate:.0%} of tokens resampled per sample")
    print(f"{'tokens/text':>11} {'scan us':>9} {'index us':>9} {'ratio':>7} {'scan hits':>9} {'index hits':>10} "
          f"{'index B/token':>13}")
    for length in (int(x) for x in args.length.split(",")):
        texts = make_group(args.samples, length, args.vocab, args.mutate, args.seed)
        half = length // 2
        running = [t[:half] for t in texts[: args.samples]]
        finished = texts[args.samples:]
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        group = GroupIndex()
        for t in finished:
            group.add("sibling", t, finished=True)
        docs = [group.add("sibling", t, live=True) for t in running]
        group.find(running[0], exclude=docs[0])  # the texts are indexed at the first search
        index_bytes = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        scan_us, index_us, scan_hits, index_hits = [], [], 0, 0
        for i, own in enumerate(running):
            # the sample diverged from every text at its last token: nothing is aligned, a real resync
            generated = own.copy()
            generated[-1] = (generated[-1] + 1) % args.vocab
            others = [t for j, t in enumerate(running) if j != i] + finished
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                a = scan_resync(others, generated)
                t1 = time.perf_counter()
                b = group.find(generated, exclude=docs[i])
                t2 = time.perf_counter()
                scan_us.append((t1 - t0) * 1e6)
                index_us.append((t2 - t1) * 1e6)
            truth = texts[i][half]  # the sample's own next token
            a = scan_resync(others, own)
            b = group.find(own, exclude=docs[i])
            scan_hits += a is not None and others[a[0]][a[1]] == truth
            index_hits += b is not None and b[0].tokens[b[1]] == truth
        s, x = statistics.median(scan_us), statistics.median(index_us)
        n = len(running)
        print(f"{length:>11,} {s:>9.1f} {x:>9.1f} {s / x:>6.1f}x {scan_hits:>5}/{n:<3} {index_hits:>6}/{n:<3} "
              f"{index_bytes / max(1, group.indexed):>13.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How fast this machine runs plain Python now: a fixed reference workload, timed.

The control plane's absolute figures (completions/s through the scheduler, scheduler CPU per
completion) and ``simulate``'s wall time are set by the CPU as much as by the code. On the
shared 2-core development machine the same commit gave 9,828 completions/s one day and 2,713
the next, and ``simulate`` at 4,096 workers took 2.5-2.9x longer (docs/LOAD.md,
docs/SIMULATOR.md): ratios measured in one run survive that, absolute targets do not. So
``loadtest``, ``simulate`` and ``bench`` print and record ``reference_ms``: the CPU time of
one fixed workload of the operations those paths are made of (dict and heap updates, small
tuples, float arithmetic, method calls), the median of a few repeats, measured as the command
starts. A figure from another day compares with one from today only beside it: half the
reference_ms, about twice the completions/s.

The machine's speed also changes *during* a run. On the development machine a core ran the
same slice of the workload in ~8.5 ms or ~15.5 ms, switching within a second, each core on
its own (2026-11-26: no steal time counted; another tenant on the host's core is the likely
reading). ``SpeedProbe`` samples every core through a measurement, so that a step that ran
on a slow core can be told from one that a policy made slow (``bench`` records it per step).
"""

from __future__ import annotations

import heapq
import math
import os
import statistics
import subprocess
import sys
import threading
import time

__all__ = ["SpeedProbe", "mean_of_cores", "reference_ms"]


class _Item:
    __slots__ = ("key", "tokens")

    def __init__(self, key: int, tokens: float):
        self.key, self.tokens = key, tokens

    def grow(self, by: float) -> float:
        self.tokens += by
        return self.tokens


def _workload(n: int = 40_000) -> float:
    """A fixed, deterministic mix; returns a checksum so that nothing is optimised away."""
    counts: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    items = [_Item(i, 0.0) for i in range(256)]
    total = 0.0
    for i in range(n):
        k = i * 2654435761 % 1_000_003
        counts[k & 4095] = counts.get(k & 4095, 0) + 1
        heapq.heappush(heap, (k, i))
        if len(heap) > 256:
            heapq.heappop(heap)
        total += items[i & 255].grow(math.sqrt(k) * 1e-3)
    return total + len(counts) + heap[0][0]


def reference_ms(repeats: int = 5) -> float:
    """Milliseconds of CPU time (this thread) one run of the reference workload takes now:
    the median of ``repeats`` runs."""
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats!r}")
    times = []
    for _ in range(repeats):
        started = time.thread_time()
        _workload()
        times.append((time.thread_time() - started) * 1e3)
    return statistics.median(times)


PROBE_ITERATIONS = 500
"""One probe sample: this many rounds of the reference workload (0.5-1.4 ms of CPU here)."""


NEAREST_PERIODS = 3
"""``SpeedProbe.median_ms``: a span without a sample takes one at most this many periods away."""


class SpeedProbe:
    """Each core's speed through a measurement: a small process per core, pinned to it, times
    ``PROBE_ITERATIONS`` rounds of the reference workload (this thread's CPU time) every
    ``interval`` seconds and writes ``clock ms`` lines (``time.monotonic``, shared by every
    process) that a thread here collects. At the default 0.1 s it takes well under 1% of each
    core. ``median_ms(t0, t1)``: per core, the median sample between two clock readings (a
    short span without one: the nearest sample, if close; else None). Use as a context
    manager; a core the process may not run on is left out, and a probe that cannot start
    raises (``start``)."""

    def __init__(self, cores: list[int] | None = None, interval: float = 0.1):
        if interval <= 0:
            raise ValueError(f"interval: must be > 0, got {interval!r}")
        # where the OS cannot pin a process (no sched_getaffinity), there is no core to probe: none is
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.cores = [c for c in (cores if cores is not None else allowed) if c in allowed]
        self.interval = interval
        self.samples: dict[int, list[tuple[float, float]]] = {c: [] for c in self.cores}
        self._procs: list[subprocess.Popen] = []
        self._readers: list[threading.Thread] = []

    def start(self) -> SpeedProbe:
        """Start a probe per core; where one cannot start, stop those that did and raise."""
        try:
            for core in self.cores:
                proc = subprocess.Popen([sys.executable, "-m", "bubblespec.bench.machine", str(core), str(self.interval)],
                                        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
                self._procs.append(proc)
                reader = threading.Thread(target=self._read, args=(core, proc), daemon=True, name=f"speed-probe-{core}")
                reader.start()
                self._readers.append(reader)
        except BaseException:
            self.stop()
            raise
        return self

    def _read(self, core: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            at, ms = line.split()
            self.samples[core].append((float(at), float(ms)))

    def stop(self) -> None:
        for proc in self._procs:
            proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for reader in self._readers:
            reader.join(timeout=5)
        self._procs, self._readers = [], []

    def __enter__(self) -> SpeedProbe:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def median_ms(self, t0: float, t1: float) -> dict[int, float | None]:
        """Per core, the median sample taken between ``t0`` and ``t1`` (``time.monotonic``). A
        span shorter than the probe's period (a quick load-test round on fast cores) may hold
        none: it gets the sample nearest to it, where one was taken within ``NEAREST_PERIODS``
        periods of it (a core's speed changes over seconds, not milliseconds); else None."""
        out: dict[int, float | None] = {}
        for core, samples in self.samples.items():
            taken = list(samples)
            within = [ms for at, ms in taken if t0 <= at <= t1]
            if within:
                out[core] = statistics.median(within)
                continue
            gap, ms = min(((max(t0 - at, at - t1), ms) for at, ms in taken), default=(math.inf, None))
            out[core] = ms if gap <= NEAREST_PERIODS * self.interval else None
        return out


def mean_of_cores(per_core: dict) -> float | None:
    """The mean over cores of ``median_ms``'s figures (or a report's copy of them), the cores
    without a sample left out; None where none has one."""
    ms = [v for v in per_core.values() if v is not None]
    return statistics.fmean(ms) if ms else None


def _probe(core: int, interval: float) -> None:
    """The probe process: pinned to ``core``, a sample every ``interval`` seconds, until killed."""
    os.sched_setaffinity(0, {core})
    while True:
        started = time.thread_time()
        _workload(PROBE_ITERATIONS)
        ms = (time.thread_time() - started) * 1e3
        print(f"{time.monotonic():.4f} {ms:.3f}", flush=True)
        time.sleep(interval)


if __name__ == "__main__":
    try:
        _probe(int(sys.argv[1]), float(sys.argv[2]))
    except (KeyboardInterrupt, BrokenPipeError):
        pass

"""The machine reference (``bench/machine.py``): the CPU time of a fixed workload, printed beside
the control plane's and the simulator's absolute figures so that runs of different days compare."""

from __future__ import annotations

import statistics
import threading
import time

import pytest

from bubblespec.bench import machine


def test_the_reference_is_the_median_of_its_repeats_in_cpu_time(monkeypatch) -> None:
    ticks = iter([0.0, 0.010, 1.0, 1.030, 2.0, 2.020])  # three runs: 10, 30 and 20 ms of CPU
    monkeypatch.setattr(machine.time, "thread_time", lambda: next(ticks))
    assert machine.reference_ms(3) == pytest.approx(20.0)


def test_the_reference_counts_this_threads_cpu_not_the_clock() -> None:
    # another thread busy beside it takes the GIL about half the time: the wall clock over the
    # run doubles, the reference's CPU time does not. Both are read over the same run, so the
    # machine's own speed spells move them together (comparing runs apart was flaky here)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin)
    t.start()
    try:
        started = time.perf_counter()
        cpu = machine.reference_ms(1)
        wall = (time.perf_counter() - started) * 1e3
    finally:
        stop.set()
        t.join()
    assert 0 < cpu < 0.8 * wall


def test_a_bad_repeat_count_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="repeats"):
        machine.reference_ms(0)


def test_the_probe_samples_every_core_it_may_run_on_and_reads_a_span() -> None:
    import os
    import time

    cores = sorted(os.sched_getaffinity(0))
    with machine.SpeedProbe(cores + [max(cores) + 1000], interval=0.02) as probe:  # the last core is not ours
        time.sleep(0.5)
        t0 = time.monotonic()
        time.sleep(0.5)
        t1 = time.monotonic()
        time.sleep(0.2)
    assert probe.cores == cores
    spans = probe.median_ms(t0, t1)
    assert set(spans) == set(cores)
    for core in cores:
        inside = [ms for at, ms in probe.samples[core] if t0 <= at <= t1]
        assert len(inside) >= 5 and spans[core] == statistics.median(inside)
        assert all(ms > 0 for _, ms in probe.samples[core])
        assert len(probe.samples[core]) > len(inside)  # samples outside the span were taken, and left out
    assert probe.median_ms(t1 + 100, t1 + 200) == {c: None for c in cores}  # nothing sampled then
    assert probe._procs == []  # stopped and reaped


def test_a_span_shorter_than_the_probes_period_reads_the_nearest_sample_if_close() -> None:
    import os

    core = min(os.sched_getaffinity(0))
    probe = machine.SpeedProbe([core], interval=0.1)  # not started: its samples set here
    probe.samples[core] = [(10.0, 1.0), (10.1, 2.0)]
    assert probe.median_ms(10.03, 10.05) == {core: 1.0}  # 0.03 s after the first sample
    assert probe.median_ms(10.07, 10.08) == {core: 2.0}  # 0.02 s before the second
    assert probe.median_ms(10.0, 10.1) == {core: 1.5}  # both inside: their median
    assert probe.median_ms(10.45, 10.5) == {core: None}  # 0.35 s past the last: more than 3 periods
    assert probe.median_ms(10.35, 10.5) == {core: 2.0}  # 0.25 s: within them
    probe.samples[core] = []
    assert probe.median_ms(10.0, 10.1) == {core: None}


def test_a_bad_probe_interval_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="interval"):
        machine.SpeedProbe(interval=0)


def test_where_no_process_can_be_pinned_the_probe_samples_nothing_and_says_so(monkeypatch) -> None:
    monkeypatch.delattr(machine.os, "sched_getaffinity")
    with machine.SpeedProbe() as probe:
        assert probe.cores == [] and probe._procs == []
    assert probe.median_ms(0.0, 1e12) == {}


def test_a_probe_that_cannot_start_on_every_core_stops_those_it_started_and_raises(monkeypatch) -> None:
    import os
    import subprocess

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    started: list = []
    real = subprocess.Popen

    def popen(*args, **kwargs):
        if started:
            raise OSError("no more processes")
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(machine.subprocess, "Popen", popen)
    probe = machine.SpeedProbe()
    with pytest.raises(OSError, match="no more processes"):
        probe.start()
    assert started[0].poll() is not None and probe._procs == []  # the first one stopped and reaped

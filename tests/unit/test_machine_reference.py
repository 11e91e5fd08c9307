"""The machine reference (``bench/machine.py``): the CPU time of a fixed workload, printed beside
the control plane's and the simulator's absolute figures so that runs of different days compare."""

from __future__ import annotations

import statistics
import threading

import pytest

from bubblespec.bench import machine


def test_the_reference_is_the_median_of_its_repeats_in_cpu_time(monkeypatch) -> None:
    ticks = iter([0.0, 0.010, 1.0, 1.030, 2.0, 2.020])  # three runs: 10, 30 and 20 ms of CPU
    monkeypatch.setattr(machine.time, "thread_time", lambda: next(ticks))
    assert machine.reference_ms(3) == pytest.approx(20.0)


def test_the_reference_counts_this_threads_cpu_not_the_clock() -> None:
    # another thread busy beside it takes the GIL half the time: the wall clock doubles, the
    # reference's CPU time does not (within what a shared machine allows)
    alone = machine.reference_ms(3)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin)
    t.start()
    try:
        beside = machine.reference_ms(3)
    finally:
        stop.set()
        t.join()
    assert 0 < alone and 0 < beside < 1.6 * alone


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


def test_a_bad_probe_interval_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="interval"):
        machine.SpeedProbe(interval=0)


def test_where_no_process_can_be_pinned_the_probe_samples_nothing_and_says_so(monkeypatch) -> None:
    monkeypatch.delattr(machine.os, "sched_getaffinity")
    with machine.SpeedProbe() as probe:
        assert probe.cores == [] and probe._procs == []
    assert probe.median_ms(0.0, 1e12) == {}

"""Prometheus helpers shared by the scheduler's and the worker's exporters.

The scheduler and the worker never import each other; both build their metric families from
these: a ``MetricSpec`` per family (names are public API, see STYLE.md), a lock-free
``Histogram`` and ``family`` for counters and gauges. Imports prometheus_client, so the client
SDK never imports this package.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

__all__ = ["Histogram", "MetricKind", "MetricSpec", "family"]

MetricKind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric family: its full name (counters with ``_total``), kind, labels, help."""

    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()


class Histogram:
    """Cumulative bucket counts and a sum; not thread-safe (the owner holds a lock)."""

    def __init__(self, buckets: Iterable[float]):
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # last slot: above the highest bound
        self.sum = 0.0

    def observe(self, value: float, count: int = 1, total: float | None = None) -> None:
        """Count ``count`` observations of ``value``; ``total`` overrides the amount added to the sum."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count if total is None else total

    def family(self, spec: MetricSpec) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, n in zip((*(repr(float(b)) for b in self.bounds), "+Inf"), self.counts):
            running += n
            cumulative.append((bound, running))
        return HistogramMetricFamily(spec.name, spec.help, buckets=cumulative, sum_value=self.sum)


def family(spec: MetricSpec, samples: Iterable[tuple[tuple[str, ...], float]]) -> Metric:
    """A counter or gauge family from ``(label values, value)`` pairs."""
    base = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
    cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
    fam = cls(base, spec.help, labels=list(spec.labels))
    for values, value in samples:
        fam.add_metric(list(values), value)
    return fam

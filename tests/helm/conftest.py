"""Fixtures of the Helm chart tests (helpers live in helm_support.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from helm_support import CHART_DIR, NAMESPACE, RELEASE, VALUE_SETS, Rendered, parse


@pytest.fixture(scope="session")
def chart():
    helm_chart = pytest.importorskip("helm_python.chart", reason="needs: pip install helm-python-sdk")
    with helm_chart.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart):
    """render(values) -> Rendered, cached per value set."""
    cache: dict[str, Rendered] = {}

    def _render(values: dict[str, Any]) -> Rendered:
        key = yaml.safe_dump(values, sort_keys=True)
        if key not in cache:
            files = chart.render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)
            cache[key] = Rendered(files, parse(files))
        return cache[key]

    return _render


@pytest.fixture(params=sorted(VALUE_SETS), scope="session")
def value_set(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def rendered(render, value_set) -> Rendered:
    return render(VALUE_SETS[value_set])

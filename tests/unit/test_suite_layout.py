"""The suite's own layout: pytest imports test modules by basename (no ``__init__.py`` under
tests/), so two modules with one name in different folders stop the whole run at collection."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique_across_folders():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    twice = sorted(name for name, count in names.items() if count > 1)
    assert not twice, f"rename one of each: {twice}"

"""Every page at the top of docs/ stays one a user reads in minutes: at most 400 lines. Dated
measurements belong in docs/results/ (newest first in its README.md), which has no such cap."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
MAX_LINES = 400


def test_docs_exist():
    assert sorted(p.name for p in DOCS.glob("*.md")), f"no pages in {DOCS}"


def test_every_top_level_page_is_at_most_400_lines():
    long = {p.name: n for p in sorted(DOCS.glob("*.md")) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"docs/ pages over {MAX_LINES} lines (move dated measurements to docs/results/): {long}"


def test_results_index_lists_every_results_file():
    index = (DOCS / "results" / "README.md").read_text()
    missing = [p.name for p in sorted((DOCS / "results").glob("*.md")) if p.name != "README.md" and p.name not in index]
    assert not missing, f"docs/results/README.md does not list: {missing}"

"""``bench``'s per-worker rows: where a step's tail was and how far drafts carried it."""

from __future__ import annotations

from bubblespec.cli.bench import _per_worker
from bubblespec.common.types import Completion, FinishReason, Provenance, SourceStats, StepResult, StepSummary


def completion(worker: str, tokens: int, passes: int, *sources: SourceStats) -> Completion:
    return Completion("s", f"p{tokens}", 0, tuple(range(tokens)), (), "", FinishReason.LENGTH, 1, worker,
                      provenance=Provenance(passes, sources))


def test_per_worker_rows_name_each_workers_longest_response_and_its_drafts():
    r = StepResult((completion("w0", 10, 10),
                    completion("w0", 300, 120, SourceStats("future", 200, 180), SourceStats("sibling", 40, 0)),
                    completion("w1", 50, 5, SourceStats("history", 45, 45))), StepSummary("s", 1, 3, 1.0, 360))
    rows = _per_worker(r)
    assert rows["w0"] == {"requests": 2, "tokens": 310, "longest": 300, "forward_passes": 130, "longest_forward_passes": 120,
                          "longest_accepted": {"future": 180}, "longest_drafted": {"future": 200, "sibling": 40}}
    assert rows["w1"]["longest_drafted"] == rows["w1"]["longest_accepted"] == {"history": 45}

"""``bubblespec calibrate``'s least-squares fit recovers a known cost model."""

import pytest

from bubblespec.cli.calibrate import Observation, fit


def test_fit_recovers_the_linear_cost_model():
    truth = dict(base_seconds=3e-3, per_seq_seconds=2e-4, per_draft_token_seconds=4e-5, prefill_per_token_seconds=2e-5)

    def seconds(batch, drafts, prefill):
        return (truth["base_seconds"] + truth["per_seq_seconds"] * batch
                + truth["per_draft_token_seconds"] * drafts + truth["prefill_per_token_seconds"] * prefill)

    points = [(1, 0, 0.2), (1, 7, 1.2), (4, 0, 0.7), (4, 26, 5), (16, 0, 3), (16, 100, 20)]
    obs = [Observation(b, d, p, seconds(b, d, p)) for b, d, p in points]
    overhead = 4e-3  # per request: cancels between the two prefill runs
    obs += [Observation(1, 0, n, seconds(1, 0, n) + overhead, kind="prefill") for n in (16, 512)]
    assert fit(obs) == pytest.approx(truth, rel=1e-6)


def test_fit_clips_negative_constants_to_zero():
    obs = [Observation(b, 0.0, 0.0, 0.01 - 1e-4 * b) for b in (1, 2, 4, 8)]  # cheaper with batch
    assert fit(obs)["per_seq_seconds"] == 0.0

"""Draft candidates are cut at the first token id the model does not have."""

import numpy as np

from bubblespec.worker.proposer import _valid_prefix


def test_candidates_stop_before_out_of_vocabulary_ids():
    tokens = np.array([5, 9, 99, 100, 7], dtype=np.int64)
    assert _valid_prefix(tokens, 100).tolist() == [5, 9, 99]
    assert _valid_prefix(tokens, 101).tolist() == [5, 9, 99, 100, 7]
    assert _valid_prefix(np.array([120, 1]), 100).tolist() == []

"""flatten_step: the flat arrays of one forward, and its refusals."""

import pytest

from engine.model.flat_step import flatten_step


def test_flatten_keeps_chunks_contiguous_and_points_at_last_rows():
    step = flatten_step({3: ([1, 2, 3], 5), 7: ([9], 0), 0: ([4, 4], 2)})
    tokens, positions, seq_ids, last = step.tokens, step.positions, step.seq_ids, step.logits_indices
    assert tokens.tolist() == [1, 2, 3, 9, 4, 4]
    assert positions.tolist() == [5, 6, 7, 0, 2, 3]
    assert seq_ids.tolist() == [3, 3, 3, 7, 0, 0]
    assert last.tolist() == [2, 3, 5]


@pytest.mark.parametrize("chunks", [{}, {1: ([], 0)}, {1: ([5], -1)}])
def test_flatten_refuses_empty_steps_chunks_and_negative_starts(chunks):
    with pytest.raises(ValueError):
        flatten_step(chunks)

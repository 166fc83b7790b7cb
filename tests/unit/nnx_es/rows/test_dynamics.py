"""Training dynamics ("dataset cartography"): the streaming fold against the definitions."""

from __future__ import annotations

import numpy as np
import pytest

from nnx_es.rows.columns import VALUES, EpochRows, RowView
from nnx_es.rows.dynamics import Cartography, cartography, fold


def _epoch(epoch, ids, conf, correct, split="train"):
    values = np.zeros((len(VALUES), len(ids)), np.float32)
    values[VALUES.index("confidence")] = conf
    values[VALUES.index("correct")] = correct
    return EpochRows(epoch, split, np.asarray(ids, np.int64), values)


def test_the_fold_gives_the_mean_the_population_std_and_the_fraction_correct():
    rng = np.random.default_rng(0)
    conf = rng.random((6, 5)).astype(np.float32)  # 6 epochs, 5 rows
    correct = (rng.random((6, 5)) > 0.4).astype(np.float32)
    state = Cartography.empty()
    for e in range(6):
        state = fold(state, _epoch(e, [10, 11, 12, 13, 14], conf[e], correct[e]))
    c64 = conf.astype(np.float64)
    np.testing.assert_allclose(state.confidence, c64.mean(0), rtol=1e-12)
    np.testing.assert_allclose(state.variability, c64.std(0), rtol=1e-9)  # population std (ddof=0), as the paper
    np.testing.assert_array_equal(state.correctness, correct.astype(np.int64).sum(0) / 6)
    assert state.epochs.tolist() == [6] * 5


def test_rows_joining_later_or_missing_an_epoch_count_only_their_own_epochs():
    state = fold(Cartography.empty(), _epoch(0, [5, 9], [0.2, 0.4], [0, 1]))
    state = fold(state, _epoch(1, [1, 9], [0.6, 0.8], [1, 1]))
    state = fold(state, _epoch(2, [1, 5, 9], [1.0, 0.6, 0.6], [1, 0, 1]))
    assert state.row_id.tolist() == [1, 5, 9]
    assert state.epochs.tolist() == [2, 2, 3]
    np.testing.assert_allclose(state.confidence, [0.8, 0.4, np.float32(0.4) / 3 + np.float32(0.8) / 3 + np.float32(0.6) / 3],
                               rtol=1e-6)
    np.testing.assert_allclose(state.correctness, [1.0, 0.0, 1.0])


def test_the_fold_is_pure_and_keeps_a_constant_state_per_row():
    first = fold(Cartography.empty(), _epoch(0, [0, 1, 2], [0.1, 0.5, 0.9], [0, 1, 1]))
    snapshot = [a.copy() for a in first]
    second = fold(first, _epoch(1, [0, 1, 2], [0.3, 0.5, 0.7], [1, 1, 1]))
    assert all(np.array_equal(a, b) for a, b in zip(first, snapshot))  # the old state is not changed
    assert [a.shape for a in second] == [a.shape for a in first] == [(3,)] * 5


def test_hardest_rows_are_the_least_confident_first():
    state = fold(Cartography.empty(), _epoch(0, [0, 1, 2, 3], [0.9, 0.1, 0.5, 0.1], [1, 0, 1, 0]))
    state = fold(state, _epoch(1, [0, 1, 2, 3], [0.9, 0.1, 0.5, 0.3], [1, 0, 1, 0]))
    assert state.row_id[state.hardest(3)].tolist() == [1, 3, 2]


def test_cartography_refuses_records_without_confidence_or_of_validation():
    with pytest.raises(ValueError, match="training dynamics need a classifier's records"):
        fold(Cartography.empty(), _epoch(0, [0], [np.nan], [np.nan]))
    with pytest.raises(ValueError, match="folds training records, got the 'val' split"):
        fold(Cartography.empty(), _epoch(0, [0], [0.5], [1], split="val"))


def test_cartography_of_a_view_folds_only_training_epochs():
    view = RowView([_epoch(0, [0], [0.2], [0]), _epoch(0, [0], [0.9], [1], split="val"), _epoch(1, [0], [0.4], [1])])
    state = cartography(view)
    np.testing.assert_allclose(state.confidence, [np.float32(0.2) / 2 + np.float32(0.4) / 2])
    assert state.epochs.tolist() == [2]

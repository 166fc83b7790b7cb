"""Training dynamics per row ("dataset cartography", Swayamdipta et al., EMNLP 2020).

For each training row, across the epochs that trained it, from the per-row records
(:mod:`nnx_es.rows.columns`):

``confidence``
    the mean probability the model gave the row's true label, ``mu_i = 1/E sum_e p_e(y_i | x_i)``;
``variability``
    its standard deviation across those epochs, ``sigma_i = sqrt(1/E sum_e (p_e - mu_i)^2)``
    (the paper's population form);
``correctness``
    the fraction of those epochs in which the row was predicted correctly.

Low confidence with low variability marks rows the model never learns ("hard to learn" --
where mislabelled rows gather); high variability marks rows it flips on ("ambiguous").

:func:`fold` is a streaming fold: each epoch's training records update a state of a few numbers
per row (count, running mean and sum of squared deviations by Welford's method, count correct),
so the memory is constant per row, whatever the number of epochs; :func:`cartography` folds a
run's committed records one epoch at a time.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from nnx_es.rows.columns import ID, EpochRows, Part, RowView

__all__ = ["Cartography", "cartography", "fold"]


class Cartography(NamedTuple):
    """The per-row dynamics state, sorted by row id: ``row_id`` int64 ``(N,)``, ``epochs`` int64
    (epochs folded), ``mean`` / ``m2`` float64 (running mean and sum of squared deviations of the
    confidence), ``correct`` int64 (epochs correct)."""

    row_id: np.ndarray
    epochs: np.ndarray
    mean: np.ndarray
    m2: np.ndarray
    correct: np.ndarray

    @classmethod
    def empty(cls) -> Cartography:
        return cls(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0), np.empty(0), np.empty(0, np.int64))

    @property
    def confidence(self) -> np.ndarray:
        """Mean confidence in the true label, float64 ``(N,)``."""
        return self.mean

    @property
    def variability(self) -> np.ndarray:
        """Standard deviation of that confidence across epochs, float64 ``(N,)``."""
        return np.sqrt(self.m2 / np.maximum(self.epochs, 1))

    @property
    def correctness(self) -> np.ndarray:
        """Fraction of epochs predicted correctly, float64 ``(N,)``."""
        return self.correct / np.maximum(self.epochs, 1)

    def columns(self) -> dict[str, np.ndarray]:
        """``{"row_id", "epochs", "confidence", "variability", "correctness"}``."""
        return {ID: self.row_id, "epochs": self.epochs, "confidence": self.confidence,
                "variability": self.variability, "correctness": self.correctness}

    def hardest(self, n: int) -> np.ndarray:
        """Indices of the ``n`` rows of lowest mean confidence (ties: lower variability, then row id first)."""
        order = np.lexsort((self.row_id, self.variability, self.confidence))
        return order[: max(0, n)]


def fold(state: Cartography, records: EpochRows) -> Cartography:
    """``state`` with one epoch's training records folded in (a new state; ``state`` is not changed).

    Raises:
        ValueError: ``records`` are not training records, or have no confidence (a regression's
            records: cartography needs a classifier's).
    """
    if records.split != "train":
        raise ValueError(f"cartography folds training records, got the {records.split!r} split")
    conf = records.column("confidence").astype(np.float64)
    scored = ~(np.isnan(conf) & np.isnan(records.column("correct")))  # unscored: a target the loss ignores
    if conf.size and (np.isnan(conf[scored]).any() or not scored.any()):
        raise ValueError(f"epoch {records.epoch}'s records have no confidence (NaN): training dynamics need a "
                         "classifier's records (the probability of the true label)")
    conf = conf[scored]
    ids = records.row_id[scored]
    if state.row_id.size and np.array_equal(state.row_id, ids):
        at, grown = np.arange(ids.size), state
    else:
        union = np.union1d(state.row_id, ids)
        if union.size == state.row_id.size:
            grown = state
        else:
            old = np.searchsorted(union, state.row_id)
            grown = Cartography(union, *(_spread(a, old, union.size) for a in state[1:]))
        at = np.searchsorted(grown.row_id, ids)
    epochs, mean, m2, correct = grown.epochs.copy(), grown.mean.copy(), grown.m2.copy(), grown.correct.copy()
    epochs[at] += 1
    delta = conf - mean[at]
    mean[at] += delta / epochs[at]
    m2[at] += delta * (conf - mean[at])
    correct[at] += records.column("correct")[scored] > 0.5
    return Cartography(grown.row_id, epochs, mean, m2, correct)


def _spread(values: np.ndarray, at: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, values.dtype)
    out[at] = values
    return out


def cartography(view: RowView) -> Cartography:
    """Fold every training epoch of ``view`` (e.g. :func:`nnx_es.rows.read_rows`), one epoch loaded at a time."""
    state = Cartography.empty()
    for part in view.parts():
        if part.split == "train":
            state = fold(state, part.load() if isinstance(part, Part) else part)
    return state

"""Per-row records as columns: one epoch's records of one split, and views over many epochs.

A record is keyed by ``(row id, epoch, split)`` -- never by batch position. Its values are
fixed-width float32 columns (:data:`VALUES`), stored sorted by row id so that a row is found
by binary search (the journal's chunks are indexed by their first and last row id):

``loss``
    the row's own loss, unweighted: ``sum_t weight_t * l_t(row)`` over the objective's terms
    (the value torch's ``reduction="none"`` gives, averaged over a row's values as the trainer
    averages them; :mod:`nnx_es.objective`).
``prediction``
    what the model predicted for the row: the class id (argmax of ``(B, C)`` outputs, or
    ``logit > 0`` for one logit ``(B, 1)``), or the output itself for a regression with one
    output per row.
``target``
    the row's target (a class id as a float, or the regression target).
``confidence``
    the probability the model gave the row's true label (softmax of ``(B, C)`` outputs -- logits
    or log-probabilities --, sigmoid of one logit); NaN for a regression, and for a row whose target
    is the loss's ``ignore_index`` (no true label: its ``loss`` is torch's unreduced 0, it counts in no
    mean, and cartography leaves it out).
``correct``
    1.0 when ``prediction`` is the target, else 0.0; NaN for a regression and an ignored target.

Views (:class:`RowView`) are what ``ctx.idps`` and :func:`nnx_es.rows.read_rows` return.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np

from nnx_es.errors import CorruptCheckpointError

__all__ = ["ID", "SPLITS", "VALUES", "EpochRows", "Part", "RowRecord", "RowView", "check_columns"]

#: the row id column (int64)
ID = "row_id"
#: the value columns (float32), in their stored order
VALUES: tuple[str, ...] = ("loss", "prediction", "target", "confidence", "correct")
#: the splits a record belongs to
SPLITS: tuple[str, ...] = ("train", "val")

_ID_DTYPE = np.dtype("<i8")
_VALUE_DTYPE = np.dtype("<f4")


class RowRecord(NamedTuple):
    """One row's record of one epoch and split (the columns are described in the module docstring)."""

    row_id: int
    epoch: int
    split: str
    loss: float
    prediction: float
    target: float
    confidence: float
    correct: float


class EpochRows:
    """One epoch's records of one split, sorted by row id.

    Args:
        epoch: 0-based. split: ``"train"`` or ``"val"``.
        row_id: int64, shape ``(N,)``, strictly increasing.
        values: float32, shape ``(len(VALUES), N)``, in :data:`VALUES` order.
    """

    __slots__ = ("epoch", "split", "row_id", "values")

    def __init__(self, epoch: int, split: str, row_id: np.ndarray, values: np.ndarray) -> None:
        self.epoch, self.split, self.row_id, self.values = epoch, split, row_id, values

    @property
    def rows(self) -> int:
        return int(self.row_id.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.row_id.nbytes + self.values.nbytes)

    def load(self) -> EpochRows:
        return self

    def column(self, name: str) -> np.ndarray:
        return self.row_id if name == ID else self.values[VALUES.index(name)]

    def slice(self, start: int, stop: int) -> EpochRows:
        return EpochRows(self.epoch, self.split, self.row_id[start:stop], self.values[:, start:stop])

    def encode(self) -> dict[str, bytes]:
        """``{column: little-endian bytes}``: ``row_id`` int64, the values float32."""
        out = {ID: np.ascontiguousarray(self.row_id, _ID_DTYPE).tobytes()}
        for i, name in enumerate(VALUES):
            out[name] = np.ascontiguousarray(self.values[i], _VALUE_DTYPE).tobytes()
        return out

    @classmethod
    def decode(cls, epoch: int, split: str, rows: int, columns: dict[str, bytes]) -> EpochRows:
        """The inverse of :meth:`encode`.

        Raises:
            CorruptCheckpointError: a column is missing or does not hold ``rows`` values.
        """
        problem = check_columns(rows, columns)
        if problem:
            raise CorruptCheckpointError(f"per-row records of epoch {epoch} ({split}): {problem}")
        row_id = np.frombuffer(columns[ID], _ID_DTYPE)
        values = np.empty((len(VALUES), rows), np.float32)
        for i, name in enumerate(VALUES):
            values[i] = np.frombuffer(columns[name], _VALUE_DTYPE)
        return cls(epoch, split, row_id, values)


def check_columns(rows: int, columns: dict[str, bytes]) -> str | None:
    """What is wrong with encoded columns of ``rows`` records (a missing column, a wrong length), or ``None``."""
    for name, width in ((ID, _ID_DTYPE.itemsize), *((v, _VALUE_DTYPE.itemsize) for v in VALUES)):
        data = columns.get(name)
        if data is None:
            return f"column {name!r} is missing"
        if len(data) != rows * width:
            return f"column {name!r} holds {len(data)} bytes, expected {rows * width} for {rows} rows"
    return None


class Part:
    """A lazily loaded :class:`EpochRows` (a journal's epoch): ``epoch``, ``split``, ``rows``, ``load()``.

    ``find(row_id)``: the loaded records holding ``row_id`` (or ``None``); the default loads everything.
    """

    def __init__(self, epoch: int, split: str, rows: int, load: Callable[[], EpochRows],
                 find: Callable[[int], EpochRows | None] | None = None) -> None:
        self.epoch, self.split, self.rows = epoch, split, rows
        self._load, self._find = load, find

    def load(self) -> EpochRows:
        return self._load()

    def find(self, row_id: int) -> EpochRows | None:
        return self._find(row_id) if self._find is not None else self._load()


class RowView:
    """Per-row records of some epochs, as rows and as columns (numpy arrays).

    ``ctx.idps`` (the window in memory, or the full history for a callback declaring
    ``history_access = "full"``) and :func:`nnx_es.rows.read_rows` (a run's committed records)
    return one. Records are ordered by epoch, then split (train before val), then row id.
    """

    def __init__(self, parts: Iterable[EpochRows | Part] = ()) -> None:
        self._parts: list[EpochRows | Part] = sorted(parts, key=lambda p: (p.epoch, SPLITS.index(p.split)))

    @property
    def epochs(self) -> tuple[int, ...]:
        """The epochs holding records (0-based, increasing)."""
        return tuple(sorted({p.epoch for p in self._parts}))

    def __len__(self) -> int:
        return sum(p.rows for p in self._parts)

    def _select(self, split: str | None, epochs: Iterable[int] | None) -> list[EpochRows | Part]:
        if split is not None and split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
        wanted = None if epochs is None else set(epochs)
        return [p for p in self._parts if (split is None or p.split == split) and (wanted is None or p.epoch in wanted)]

    def columns(self, split: str | None = None, epochs: Iterable[int] | None = None) -> dict[str, np.ndarray]:
        """``{"row_id": int64, "epoch": int32, "split": str, <VALUES>: float32}``, each of shape ``(N,)``.

        Args:
            split: ``"train"``, ``"val"`` or ``None`` (both).
            epochs: the epochs wanted (``None``: every one).

        Raises:
            ValueError: an unknown split.
            CorruptCheckpointError: a journal chunk is missing or does not verify.
        """
        loaded = [p.load() for p in self._select(split, epochs)]
        out: dict[str, np.ndarray] = {
            ID: np.concatenate([p.row_id for p in loaded]) if loaded else np.empty(0, np.int64),
            "epoch": np.concatenate([np.full(p.rows, p.epoch, np.int32) for p in loaded]) if loaded
            else np.empty(0, np.int32),
            "split": np.concatenate([np.full(p.rows, p.split) for p in loaded]) if loaded else np.empty(0, "<U5"),
        }
        for i, name in enumerate(VALUES):
            out[name] = np.concatenate([p.values[i] for p in loaded]) if loaded else np.empty(0, np.float32)
        return out

    def rows(self, split: str | None = None, epochs: Iterable[int] | None = None) -> list[RowRecord]:
        """The same records as :meth:`columns`, one :class:`RowRecord` each."""
        c = self.columns(split, epochs)
        values = [c[name].tolist() for name in VALUES]
        return [RowRecord(r, e, s, *v) for r, e, s, *v in zip(c[ID].tolist(), c["epoch"].tolist(),
                                                               c["split"].tolist(), *values)]

    def row(self, row_id: int, split: str = "train") -> list[RowRecord]:
        """Every epoch's record of one row (indexed: a journal loads only the chunk holding it)."""
        out = []
        for p in self._select(split, None):
            found = p.find(row_id) if isinstance(p, Part) else p
            if found is None:
                continue
            i = int(np.searchsorted(found.row_id, row_id))
            if i < found.rows and int(found.row_id[i]) == row_id:
                out.append(RowRecord(row_id, p.epoch, p.split, *(float(v) for v in found.values[:, i])))
        return out

    def parts(self) -> Sequence[EpochRows | Part]:
        """The per-(epoch, split) parts, unloaded where they are lazy."""
        return tuple(self._parts)

"""Per-row records ("idps"): every row's loss, prediction and target, per epoch and split.

Datasets yield row ids through the batch contract (:mod:`nnx_es.batches`: a mapping's
``"idx"``, or ``(x, y, w, idx)``); :func:`with_row_ids` adds them to a ``TensorDataset``.
The trainer then records, for every row id and epoch, training's and the epoch's validation's
values (:mod:`nnx_es.rows.columns`), keyed by ``(row id, epoch)``; callbacks read them as
``ctx.idps``; :func:`read_rows` returns a run's committed records; :class:`HistoryJournal`
stores them as chunks instead of log events; :class:`Cartography` folds training dynamics.

The names load on first use (PEP 562): the readers and ``tools/replay`` never import torch.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nnx_es.rows.columns import ID, SPLITS, VALUES, EpochRows, RowRecord, RowView
    from nnx_es.rows.dataset import RowIdDataset, with_row_ids
    from nnx_es.rows.dynamics import Cartography, cartography
    from nnx_es.rows.journal import HistoryJournal, verify_manifest
    from nnx_es.rows.reader import read_rows
    from nnx_es.rows.recorder import RowRecorder, row_values

_LAZY = {
    "ID": "columns", "SPLITS": "columns", "VALUES": "columns", "EpochRows": "columns", "RowRecord": "columns",
    "RowView": "columns", "RowIdDataset": "dataset", "with_row_ids": "dataset", "Cartography": "dynamics",
    "cartography": "dynamics", "HistoryJournal": "journal", "verify_manifest": "journal", "read_rows": "reader",
    "RowRecorder": "recorder", "row_values": "recorder",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nnx_es.rows' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"nnx_es.rows.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "ID",
    "SPLITS",
    "VALUES",
    "Cartography",
    "EpochRows",
    "HistoryJournal",
    "RowIdDataset",
    "RowRecord",
    "RowRecorder",
    "RowView",
    "cartography",
    "read_rows",
    "row_values",
    "verify_manifest",
    "with_row_ids",
]

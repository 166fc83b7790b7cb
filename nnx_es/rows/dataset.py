"""Row ids for a ``TensorDataset``: :func:`with_row_ids`.

The batch contract (:mod:`nnx_es.batches`) carries row ids as a mapping batch's ``"idx"``
key. :class:`RowIdDataset` is a ``TensorDataset`` whose items are such mappings, so the
default ``DataLoader`` collate yields ``{"x": (B, ...), "y": (B, ...), "idx": (B,) int64}``
(and ``"weight"`` when the data set has a third tensor), and the trainer's gathered batches
(:mod:`nnx_es.data`) yield the same mappings without a Python call per row.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

from nnx_es.errors import ConfigError

__all__ = ["RowIdDataset", "carries_row_ids", "with_row_ids"]


class RowIdDataset(TensorDataset):
    """A ``TensorDataset`` of ``x``, ``y`` (and ``weight``) whose items carry their row id.

    Item ``i`` is ``{"x": x[i], "y": y[i], ("weight": w[i],) "idx": ids[i]}``; ``tensors`` holds
    the data set's tensors followed by the ids (int64, shape ``(N,)``).

    Args:
        dataset: a ``TensorDataset`` of two tensors (inputs, targets) or three (with per-row
            weights, read as the batch's ``"weight"``).
        ids: int64 ``(N,)``, unique; default ``arange(N)`` (the row's position in ``dataset``).

    Raises:
        ConfigError: not a ``TensorDataset`` of 2 or 3 tensors, or ids of another shape or dtype,
            or ids that are not unique (a record is keyed by its row id).
    """

    def __init__(self, dataset: TensorDataset, ids: Tensor | None = None) -> None:
        if not isinstance(dataset, TensorDataset) or isinstance(dataset, RowIdDataset):
            raise ConfigError(f"with_row_ids needs a torch TensorDataset(x, y[, weights]), got {type(dataset).__name__}")
        tensors = dataset.tensors
        if len(tensors) not in (2, 3):
            raise ConfigError(f"with_row_ids needs a TensorDataset of 2 tensors (x, y) or 3 (x, y, weights), got "
                              f"{len(tensors)}")
        n = len(dataset)
        if ids is None:
            ids = torch.arange(n, dtype=torch.int64)
        elif not isinstance(ids, Tensor) or ids.dtype != torch.int64 or tuple(ids.shape) != (n,):
            got = f"{ids.dtype} of shape {tuple(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
            raise ConfigError(f"row ids must be an int64 tensor of shape ({n},), one per row, got {got}")
        elif int(torch.unique(ids).numel()) != n:
            raise ConfigError(f"row ids must be unique (records are keyed by row id), got {n - int(torch.unique(ids).numel())}"
                              " repeated ids")
        self.keys: tuple[str, ...] = ("x", "y", "weight", "idx")[: len(tensors)] + ("idx",)
        super().__init__(*tensors, ids)

    def __getitem__(self, index: Any) -> dict[str, Tensor]:
        return {k: t[index] for k, t in zip(self.keys, self.tensors)}

    def batch(self, index: Tensor) -> dict[str, Tensor]:
        """The collated batch of rows ``index`` (int64 ``(B,)``), as the default collate stacks it."""
        return {k: t[index].contiguous() for k, t in zip(self.keys, self.tensors)}


def with_row_ids(dataset: TensorDataset, ids: Tensor | None = None) -> RowIdDataset:
    """``dataset`` with each row's id (see :class:`RowIdDataset`): the trainer then records every
    row's loss, prediction and target per epoch (:mod:`nnx_es.rows`).

    Raises:
        ConfigError: see :class:`RowIdDataset`.
    """
    return RowIdDataset(dataset, ids)


def carries_row_ids(loader: Any) -> bool:
    """Whether ``loader``'s batches may carry row ids (:func:`nnx_es.batches.row_ids_of`). False only
    where they cannot: a ``DataLoader`` whose default collate stacks a plain ``TensorDataset``'s rows
    into a list of other than four tensors (no mapping, no fourth element); anything else may."""
    if type(loader) is not DataLoader or loader.collate_fn is not default_collate:
        return True
    dataset = loader.dataset
    return type(dataset) is not TensorDataset or len(dataset.tensors) == 4

"""Batches of an in-memory ``TensorDataset`` gathered in one index per tensor.

A ``DataLoader`` over a ``TensorDataset`` (no workers, the default collate)
fetches each row with ``dataset[i]`` and stacks the rows with
``default_collate``: per batch of B rows, B Python calls and one stack per
tensor. :func:`iterate_batches` yields the *same* batches -- the indices come
from the loader's own ``batch_sampler``, and each tensor is indexed once
(``tensor[indices]``) -- which costs one gather per tensor instead.

Exactness (tested against the ``DataLoader`` itself): each epoch starts the
loader's own iterator, which makes the RNG draws a ``DataLoader`` epoch makes,
in its order, and takes each batch's indices from that iterator's sampler
iterator, so the batch sampler runs exactly once, as the ``DataLoader`` runs
it. The batches are equal (values, dtypes, shapes, contiguous like
``default_collate``'s stack), a ``list`` of tensors as ``default_collate``
returns for tuple rows, and the generators end each epoch in the same state,
so a run and its resume see the same data either way. A batch of indices that
is not a non-empty list of ints goes through ``dataset[i]`` and
``default_collate``, as the ``DataLoader`` would (errors included).

A :class:`~nnx_es.rows.RowIdDataset` (rows with their ids) is gathered the same way,
into the mapping its collate gives. Any other loader -- a ``DataLoader`` subclass, another
dataset type (another ``TensorDataset`` subclass included), a custom ``collate_fn``, workers,
pinned memory, tensors off the CPU, no automatic batching -- is iterated as
given. ``Trainer(batch_gather=False)`` always iterates as given.

Either way, a ``persistent_workers=True`` loader's workers are re-seeded each epoch as
fresh workers would be (:func:`nnx_es.workers.reseed_workers`), so a resume is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

from nnx_es.device import move_batch
from nnx_es.rows.dataset import RowIdDataset
from nnx_es.workers import reseed_workers

__all__ = ["gatherable", "iterate_batches"]

#: the attribute of a DataLoader iterator holding its batch sampler's iterator (torch <= 2.13)
_SAMPLER_ITER = "_sampler_iter"


def gatherable(loader: Iterable[Any]) -> bool:
    """Whether ``loader``'s batches can be gathered exactly (see the module docstring)."""
    if type(loader) is not DataLoader:
        return False
    ds = loader.dataset
    return (
        type(ds) in (TensorDataset, RowIdDataset)
        and loader.num_workers == 0
        and loader.collate_fn is default_collate
        and not loader.pin_memory
        and loader.batch_sampler is not None
        and all(t.device.type == "cpu" for t in ds.tensors)
    )


def iterate_batches(loader: Iterable[Any], *, gather: bool = True, device: torch.device | None = None) -> Iterator[Any]:
    """Iterate ``loader`` once: by gathering when :func:`gatherable`, else as given.

    ``device``: move each batch's tensors there (:func:`nnx_es.device.move_batch`; without blocking
    when the loader pins memory); ``None``: batches as they come.
    """
    non_blocking = device is not None and bool(getattr(loader, "pin_memory", False)) and device.type != "cpu"
    reseed_workers(loader)
    if not (gather and gatherable(loader)):
        if device is None:
            return iter(loader)
        # no generator frame around the loader's: one call per batch, the move's
        return map(partial(move_batch, device=device, non_blocking=non_blocking), loader)
    return _gathered(loader, device, non_blocking)


def _gathered(loader: Iterable[Any], device: torch.device | None, non_blocking: bool) -> Iterator[Any]:
    """The batches of a :func:`gatherable` loader, gathered (see the module docstring)."""
    if device is not None and device.type == "cpu":
        device = None  # gatherable: every tensor of the data set is on the CPU already
    assert isinstance(loader, DataLoader)
    dataset = loader.dataset
    tensors = dataset.tensors  # type: ignore[attr-defined]
    # the DataLoader's own iterator starts the epoch (its RNG draws, in its order); its sampler
    # iterator then gives each batch's indices, so a sampler runs exactly as the DataLoader runs it
    epoch = iter(loader)
    indices_of = getattr(epoch, _SAMPLER_ITER, None)
    if indices_of is None:  # a torch whose iterator keeps them elsewhere: this epoch as given
        yield from epoch
        return
    for indices in indices_of:
        index = torch.as_tensor(indices)
        if index.dtype != torch.long or index.dim() != 1 or index.numel() == 0:
            batch = default_collate([dataset[i] for i in indices])  # exactly what the DataLoader does
        elif type(dataset) is RowIdDataset:  # mapping rows (with their ids): collated to a mapping
            batch = dataset.batch(index)
        else:  # default_collate stacks rows into a new contiguous tensor: so does this
            batch = [t[index].contiguous() for t in tensors]
        yield batch if device is None else move_batch(batch, device, non_blocking)

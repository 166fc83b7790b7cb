"""Batches of an in-memory ``TensorDataset`` gathered in one index per tensor.

A ``DataLoader`` over a ``TensorDataset`` (no workers, the default collate)
fetches each row with ``dataset[i]`` and stacks the rows with
``default_collate``: per batch of B rows, B Python calls and one stack per
tensor. :func:`iterate_batches` yields the *same* batches -- the indices come
from the loader's own ``batch_sampler``, and each tensor is indexed once
(``tensor[indices]``) -- which costs one gather per tensor instead.

Exactness (tested against the ``DataLoader`` itself): each epoch first calls
``iter(loader)``, which draws what ``DataLoader`` draws from
``loader.generator`` when an epoch starts; the sampler then draws its
permutation from the same generator, in the same order. The batches are equal
(values, dtypes, shapes), a ``list`` of tensors as ``default_collate`` returns
for tuple rows, and the generator ends each epoch in the same state, so a run
and its resume see the same data either way.

Any other loader -- a ``DataLoader`` subclass, another dataset type (a
``TensorDataset`` subclass included), a custom ``collate_fn``, workers,
pinned memory, tensors off the CPU, no automatic batching -- is iterated as
given. ``Trainer(batch_gather=False)`` always iterates as given.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

__all__ = ["gatherable", "iterate_batches"]


def gatherable(loader: Iterable[Any]) -> bool:
    """Whether ``loader``'s batches can be gathered exactly (see the module docstring)."""
    if type(loader) is not DataLoader:
        return False
    ds = loader.dataset
    return (
        type(ds) is TensorDataset
        and loader.num_workers == 0
        and loader.collate_fn is default_collate
        and not loader.pin_memory
        and loader.batch_sampler is not None
        and all(t.device.type == "cpu" for t in ds.tensors)
    )


def iterate_batches(loader: Iterable[Any], *, gather: bool = True) -> Iterator[Any]:
    """Iterate ``loader`` once: by gathering when :func:`gatherable`, else as given."""
    if not (gather and gatherable(loader)):
        yield from loader
        return
    assert isinstance(loader, DataLoader) and loader.batch_sampler is not None
    tensors = loader.dataset.tensors  # type: ignore[attr-defined]
    iter(loader)  # what starting an epoch of the DataLoader draws from its generator
    for indices in loader.batch_sampler:
        index = torch.as_tensor(indices, dtype=torch.long)
        yield [t[index] for t in tensors]

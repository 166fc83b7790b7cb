"""Elastic mode's deal of the rows: a declared global batch, the same on any number of ranks.

:func:`elastic_loader` declares the global batch ``G`` of a run: the rows of every committed
update. Epoch ``e``'s permutation of the ``N`` rows is the one :func:`~nnx_es.distributed.train_loader`
draws (a generator seeded with ``seed + e``; the rows in order with ``shuffle=False``), cut into
``B = N // G`` global batches: global batch ``j`` is positions ``j*G .. (j+1)*G - 1`` of it, on
any world size, and the last ``N mod G`` positions are left out of the epoch (other rows each
epoch when shuffled), so every update has exactly ``G`` rows. On ``W`` ranks, rank ``r`` trains
the contiguous slice ``j*G + r*R .. j*G + (r+1)*R - 1`` of global batch ``j`` (``R = G / W`` rows
per rank and update), as ``k`` microbatches of ``R / k`` rows: ``k`` is the accumulation, the
smallest divisor of ``R`` that keeps a microbatch within the declared ``microbatch`` cap (1
without one). A world size that does not divide ``G`` is refused, naming the sizes that do.

The update engine divides a window's summed gradient by its denominator summed over the ranks
(spec 000 §3 "One update"), so each update is the gradient of the mean loss over the same ``G``
rows whatever ``W`` and ``k`` are: equal up to float summation order (the rows' gradients are
summed in other groups). Hence a run can stop on one world size and go on on another
(:mod:`nnx_es.distributed.resize`). MosaicML Streaming calls the same sample order on any number
of nodes "elastic determinism"; here the updates follow it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, Sampler

from nnx_es.distributed.partitions import dataset_length, partition_indices, rank_and_size
from nnx_es.errors import ConfigError

__all__ = ["GlobalBatchPlan", "GlobalBatchSampler", "elastic_loader", "global_batches", "plan_global_batch",
           "working_sizes"]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    return value


def working_sizes(global_batch: int) -> list[int]:
    """The world sizes that split ``global_batch`` rows evenly: its divisors, ascending."""
    return [w for w in range(1, global_batch + 1) if global_batch % w == 0]


@dataclass(frozen=True)
class GlobalBatchPlan:
    """How ``global_batch`` rows of an update are split on ``world_size`` ranks.

    rows_per_rank: ``global_batch / world_size`` rows each rank trains per update.
    microbatch_rows: rows of one forward (``rows_per_rank / accumulation``).
    accumulation: microbatches per update on each rank (the update engine's window).
    microbatch: the declared cap on ``microbatch_rows`` (``None``: none, one microbatch per update).
    """

    global_batch: int
    world_size: int
    microbatch: int | None
    rows_per_rank: int
    microbatch_rows: int
    accumulation: int


def plan_global_batch(global_batch: int, world_size: int, microbatch: int | None = None) -> GlobalBatchPlan:
    """Split ``global_batch`` rows over ``world_size`` ranks and their microbatches (module docstring).

    ``microbatch``: at most this many rows per forward (the memory a rank has); the accumulation is
    the smallest ``k`` dividing the rank's rows with ``rows / k <= microbatch``.

    Raises:
        ConfigError: a value that is not an int >= 1, or a ``world_size`` that does not divide
            ``global_batch`` (the message names the world sizes that do).
    """
    _positive_int("global_batch", global_batch)
    _positive_int("world_size", world_size)
    if microbatch is not None:
        _positive_int("microbatch", microbatch)
    if global_batch % world_size:
        raise ConfigError(
            f"global_batch={global_batch} rows cannot be split evenly across {world_size} ranks: every update "
            f"holds the same {global_batch} rows on any world size, so the world size must divide it; sizes that "
            f"work: {', '.join(map(str, working_sizes(global_batch)))} (or declare a global_batch that "
            f"{world_size} divides; nothing was trained)")
    rows = global_batch // world_size
    k = 1 if microbatch is None else next(d for d in range(1, rows + 1) if rows % d == 0 and rows // d <= microbatch)
    return GlobalBatchPlan(global_batch=global_batch, world_size=world_size, microbatch=microbatch,
                           rows_per_rank=rows, microbatch_rows=rows // k, accumulation=k)


def global_batches(n: int, *, global_batch: int, epoch: int, seed: int, shuffle: bool = True) -> list[list[int]]:
    """Epoch ``epoch``'s global batches of the ``n`` row positions: ``n // global_batch`` lists of
    ``global_batch`` positions, in update order (the same on every world size).

    Raises:
        ConfigError: fewer rows than one global batch.
    """
    if n < global_batch:
        raise ConfigError(f"the training data set has {n} rows, fewer than one global batch of {global_batch}: "
                          "declare a smaller global_batch")
    order = partition_indices(n, rank=0, world_size=1, epoch=epoch, seed=seed, policy="drop", shuffle=shuffle)
    return [order[j * global_batch:(j + 1) * global_batch] for j in range(n // global_batch)]


class GlobalBatchSampler(Sampler[int]):
    """Rank ``rank``'s rows of each epoch's global batches (:func:`global_batches`), in order.

    Each global batch gives this rank ``plan.rows_per_rank`` rows, which the loader batches in
    ``plan.microbatch_rows`` (a whole number of microbatches per update). Its state is
    ``(seed, epoch)``, as :class:`~nnx_es.distributed.PartitionSampler`'s: the trainer sets the
    epoch; nothing else needs restoring.

    Raises:
        ConfigError: a bad argument, a world size that does not divide ``global_batch``
            (:func:`plan_global_batch`), or fewer rows than one global batch.
    """

    def __init__(self, n: int, *, global_batch: int, rank: int, world_size: int, microbatch: int | None = None,
                 seed: int = 0, shuffle: bool = True) -> None:
        self.plan = plan_global_batch(global_batch, world_size, microbatch)
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank} is not a rank of world_size={world_size} (0 <= rank < world_size)")
        global_batches(n, global_batch=global_batch, epoch=0, seed=seed, shuffle=False)  # enough rows
        self.n, self.rank, self.world_size = n, rank, world_size
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose global batches the next iteration deals (the trainer calls it before each epoch)."""
        self.epoch = int(epoch)

    def rows(self, epoch: int) -> list[int]:
        """This rank's row positions of ``epoch``, in training order."""
        r = self.plan.rows_per_rank
        lo = self.rank * r
        return [i for batch in global_batches(self.n, global_batch=self.plan.global_batch, epoch=epoch,
                                              seed=self.seed, shuffle=self.shuffle) for i in batch[lo:lo + r]]

    def __iter__(self) -> Iterator[int]:
        return iter(self.rows(self.epoch))

    def __len__(self) -> int:
        return self.n // self.plan.global_batch * self.plan.rows_per_rank

    def describe(self) -> dict[str, Any]:
        """The deal as JSON-like builtins (every rank's alike; checkpoints record it; a resume on
        another world size must keep ``global_batch``, ``rows``, ``seed`` and ``shuffle``)."""
        p = self.plan
        return {"kind": "global_batch", "rows": self.n, "world_size": self.world_size, "global_batch": p.global_batch,
                "microbatch": p.microbatch, "microbatch_rows": p.microbatch_rows, "accumulation": p.accumulation,
                "seed": self.seed, "shuffle": self.shuffle}


def elastic_loader(dataset: Any, global_batch: int, *, microbatch: int | None = None, seed: int = 0,
                   shuffle: bool = True, rank: int | None = None, world_size: int | None = None,
                   **loader_kwargs: Any) -> DataLoader:
    """A ``DataLoader`` of this rank's share of each epoch's global batches: elastic mode (module docstring).

    A run trained on it commits every update on exactly ``global_batch`` rows and may be resumed on
    any world size that divides ``global_batch`` (:mod:`nnx_es.distributed.resize`); the trainer
    takes its accumulation from it (do not pass ``Trainer(accumulation=)``).

    Args:
        global_batch: rows per committed update, over all ranks (``G``).
        microbatch: at most this many rows per forward on a rank (default: the rank's whole share,
            ``G / world_size``, in one microbatch).
        seed / shuffle: epoch ``e`` is permuted by a generator seeded with ``seed + e``
            (``shuffle=False``: in row order).
        rank / world_size: default: the process group's (or ``RANK`` / ``WORLD_SIZE``; one process: 0 of 1).
        loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``collate_fn``, ...).

    Raises:
        ConfigError: a bad argument; a world size that does not divide ``global_batch`` (naming the
            sizes that do); fewer rows than ``global_batch``; ``sampler`` / ``batch_sampler`` /
            ``batch_size`` / ``shuffle`` / ``drop_last`` in ``loader_kwargs`` (the deal sets them).
    """
    for key in ("sampler", "batch_sampler", "batch_size", "drop_last"):
        if key in loader_kwargs:
            raise ConfigError(f"elastic_loader deals the rows and sizes the batches itself: drop {key}= "
                              f"(got {loader_kwargs[key]!r}); declare global_batch= and microbatch= instead")
    rank, world_size = rank_and_size(rank, world_size)
    sampler = GlobalBatchSampler(dataset_length(dataset), global_batch=global_batch, rank=rank, world_size=world_size,
                                 microbatch=microbatch, seed=seed, shuffle=shuffle)
    return DataLoader(dataset, batch_size=sampler.plan.microbatch_rows, sampler=sampler, **loader_kwargs)

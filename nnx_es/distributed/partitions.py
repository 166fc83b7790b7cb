"""Which rows each rank reads: the training partition of every epoch, and the validation shard.

Training (:func:`train_loader`, spec 000 §3 "Partitions"): epoch ``e``'s permutation of the
``N`` rows is drawn from a generator seeded with ``seed + e`` (the same on every rank), then
made a multiple of the world size -- ``"pad"`` repeats its leading rows (so a padded row is
read twice that epoch, as ``DistributedSampler`` does), ``"drop"`` leaves out its tail -- and
dealt round-robin: rank ``r`` reads positions ``r, r + world, r + 2 world, ...``. Every rank
then holds the same number of rows and takes the same number of steps. The trainer calls
``set_epoch`` on the loader's sampler before each epoch, so a resumed run reads the
epoch's partition again from ``(seed, epoch)`` alone.

Validation (:func:`validation_loader`): rank ``r`` scores rows ``r, r + world, ...`` of the
data set in order, unpadded: every row is scored exactly once over the ranks (unlike
``DistributedSampler``, whose padding scores some rows twice and skews the metrics), and a
rank may have no row at all.

Both take explicit ``rank`` / ``world_size`` (unit tests, other launchers); by default they
read the initialized process group, else ``RANK`` / ``WORLD_SIZE``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from nnx_es.errors import ConfigError

__all__ = ["POLICIES", "PartitionSampler", "ShardSampler", "dataset_length", "partition_indices", "rank_and_size",
           "shard_indices", "train_loader", "validation_loader"]

#: how a training partition evens the ranks' rows: repeat leading rows, or drop the tail
POLICIES = ("pad", "drop")


def rank_and_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: each given value, else the initialized process group's, else ``RANK`` /
    ``WORLD_SIZE`` (default 0 of 1).

    Raises:
        ConfigError: a value that is not an int, or a rank outside ``0 .. world_size - 1``.
    """
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
        else:
            r, w = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        rank = r if rank is None else rank
        world_size = w if world_size is None else world_size
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank} is not a rank of world_size={world_size} (0 <= rank < world_size)")
    return rank, world_size


def partition_indices(n: int, *, rank: int, world_size: int, epoch: int, seed: int, policy: str = "pad",
                      shuffle: bool = True) -> list[int]:
    """The row ids rank ``rank`` trains on in ``epoch`` (see the module docstring).

    Returns ``ceil(n / world_size)`` ids (``"pad"``) or ``n // world_size`` (``"drop"``), the
    same count on every rank.

    Raises:
        ConfigError: a bad ``policy``, no row, or ``"drop"`` with fewer rows than ranks.
    """
    if policy not in POLICIES:
        raise ConfigError(f"policy must be one of {POLICIES}, got {policy!r}")
    if n <= 0:
        raise ConfigError(f"the training data set has no row (len {n}); nothing to partition")
    if shuffle:
        g = torch.Generator().manual_seed(int(seed) + int(epoch))
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    if policy == "pad":
        total = -(-n // world_size) * world_size
        while len(order) < total:  # repeat the leading rows (more than once only with fewer rows than ranks)
            order.extend(order[:total - len(order)])
    else:
        total = n // world_size * world_size
        if total == 0:
            raise ConfigError(f"policy='drop' with {n} rows and {world_size} ranks leaves every rank without a row: "
                              "use policy='pad' or more data")
        order = order[:total]
    return order[rank:total:world_size]


def shard_indices(n: int, *, rank: int, world_size: int) -> list[int]:
    """The validation rows of rank ``rank``: ``rank, rank + world_size, ...`` below ``n`` (maybe none)."""
    return list(range(rank, n, world_size))


class PartitionSampler(Sampler[int]):
    """The training partition of one rank (:func:`partition_indices`), epoch by epoch (``set_epoch``).

    Its state is ``(seed, epoch)``: it holds no generator, so nothing of it needs restoring
    beyond the epoch the trainer sets. :meth:`describe` is what a checkpoint records.
    """

    def __init__(self, n: int, *, rank: int, world_size: int, seed: int = 0, policy: str = "pad",
                 shuffle: bool = True) -> None:
        partition_indices(n, rank=rank, world_size=world_size, epoch=0, seed=seed, policy=policy, shuffle=False)
        self.n, self.rank, self.world_size = n, rank, world_size
        self.seed, self.policy, self.shuffle = int(seed), policy, bool(shuffle)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose partition the next iteration deals (the trainer calls it before each epoch)."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(partition_indices(self.n, rank=self.rank, world_size=self.world_size, epoch=self.epoch,
                                      seed=self.seed, policy=self.policy, shuffle=self.shuffle))

    def __len__(self) -> int:
        return -(-self.n // self.world_size) if self.policy == "pad" else self.n // self.world_size

    def describe(self) -> dict[str, Any]:
        """The partition as JSON-like builtins (recorded in checkpoints; a resume must match it)."""
        return {"kind": "train", "rows": self.n, "world_size": self.world_size, "policy": self.policy,
                "seed": self.seed, "shuffle": self.shuffle}


class ShardSampler(Sampler[int]):
    """The validation shard of one rank (:func:`shard_indices`), in order, unpadded."""

    def __init__(self, n: int, *, rank: int, world_size: int) -> None:
        self.n, self.rank, self.world_size = n, rank, world_size
        self.indices = shard_indices(n, rank=rank, world_size=world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)

    def describe(self) -> dict[str, Any]:
        return {"kind": "validation", "rows": self.n, "world_size": self.world_size}


def dataset_length(dataset: Any) -> int:
    """``len(dataset)`` (rows) of a map-style data set.

    Raises:
        ConfigError: the data set has no length.
    """
    if not isinstance(dataset, Sized):
        raise ConfigError(f"dataset must have a length (a map-style Dataset), got {type(dataset).__name__}")
    return len(dataset)


def _check_batch_size(batch_size: Any) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an int >= 1 (rows per rank per batch), got {batch_size!r}")


def train_loader(dataset: Any, batch_size: int, policy: str = "pad", seed: int = 0, *, shuffle: bool = True,
                 rank: int | None = None, world_size: int | None = None, **loader_kwargs: Any) -> DataLoader:
    """A ``DataLoader`` over this rank's training partition of ``dataset`` (module docstring).

    Args:
        batch_size: rows per batch on each rank (the global batch is ``batch_size * world_size``).
        policy: ``"pad"`` (repeat leading rows) or ``"drop"`` (leave out the tail).
        seed: epoch ``e`` is permuted by a generator seeded with ``seed + e``.
        shuffle: ``False`` deals the rows in order (still padded or dropped).
        rank / world_size: default: the process group's (or ``RANK`` / ``WORLD_SIZE``).
        loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``collate_fn``, ``drop_last``, ...).

    Raises:
        ConfigError: a bad argument; ``sampler``/``shuffle``/``batch_sampler`` in ``loader_kwargs``.
    """
    _check_batch_size(batch_size)
    for key in ("sampler", "batch_sampler"):
        if key in loader_kwargs:
            raise ConfigError(f"train_loader deals the rows itself: drop {key}= (got {loader_kwargs[key]!r})")
    rank, world_size = rank_and_size(rank, world_size)
    sampler = PartitionSampler(dataset_length(dataset), rank=rank, world_size=world_size, seed=seed, policy=policy,
                               shuffle=shuffle)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_kwargs)


def validation_loader(dataset: Any, batch_size: int, *, rank: int | None = None, world_size: int | None = None,
                      **loader_kwargs: Any) -> DataLoader:
    """A ``DataLoader`` over this rank's validation shard of ``dataset``: rows ``rank::world_size``,
    in order, unpadded (it may have no batch on a rank with no row).

    Raises:
        ConfigError: a bad argument; ``sampler``/``batch_sampler`` in ``loader_kwargs``.
    """
    _check_batch_size(batch_size)
    for key in ("sampler", "batch_sampler", "shuffle"):
        if key in loader_kwargs:
            raise ConfigError(f"validation_loader shards the rows itself: drop {key}= (got {loader_kwargs[key]!r})")
    rank, world_size = rank_and_size(rank, world_size)
    sampler = ShardSampler(dataset_length(dataset), rank=rank, world_size=world_size)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_kwargs)

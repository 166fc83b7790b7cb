"""How a ``fit`` enters data parallelism: the checks made at construction, and the per-fit wrapper.

:func:`check_distributed` refuses, when the trainer is built, what this data-parallel path
does not execute (each refusal names what to do instead). :func:`data_parallel` is the
context of one ``fit``: it joins the process group (:meth:`DDP.world`), checks that every
rank takes the same number of steps, and wraps the net in ``DistributedDataParallel`` for the
update engine's data-parallel strategy (:class:`nnx_es.runtime.parallel.DataParallel`) -- the
net itself is never replaced, so checkpoints hold its own keys (no ``module.`` prefix). Without ``DDP`` it refuses a
process that is one of several ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from nnx_es.distributed.digest import params_digest, ranks_apart
from nnx_es.distributed.group import DDP, refuse_group
from nnx_es.errors import ConfigError, DivergenceError
from nnx_es.loaders import length_of
from nnx_es.runtime.run_state import World

__all__ = ["check_distributed", "data_parallel", "evaluation_world", "is_writer_rank"]

_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d,
              nn.LazyBatchNorm3d)


#: what to do about batch statistics under DDP (SyncBatchNorm runs on CUDA only)
_NORM_ADVICE = ("on GPUs (nccl) convert them with torch.nn.SyncBatchNorm.convert_sync_batchnorm(net); on CPU (gloo) "
                "SyncBatchNorm does not run: remove them, or replace them with a normalisation that uses no batch "
                "statistics (torch.nn.GroupNorm, torch.nn.LayerNorm)")


def check_distributed(distributed: Any, net: nn.Module, *, trainer_step_fn: Any = None,
                      precision: str = "fp32") -> DDP | None:
    """Validate ``Trainer(distributed=...)`` against the net and the trainer's settings.

    Raises:
        ConfigError: not a :class:`DDP`; a net already wrapped (DDP, FSDP); a BatchNorm layer (its
            statistics would differ per rank: on GPUs convert it to ``SyncBatchNorm``; on CPU remove
            it or replace it, e.g. with ``GroupNorm`` / ``LayerNorm``); a ``SyncBatchNorm`` layer on a
            machine without CUDA (torch runs it on GPUs only); a ``trainer_step_fn`` or
            ``precision="fp16"`` (not executed under DDP yet).
    """
    if distributed is None:
        return None
    if not isinstance(distributed, DDP):
        raise ConfigError(f"distributed must be nnx_es.distributed.DDP(...) or None, got {distributed!r}")
    kind = type(net).__name__
    if kind in ("DistributedDataParallel", "FullyShardedDataParallel") or type(net).__module__.startswith(
            "torch.distributed.fsdp"):
        what = "FSDP is not supported (only data parallelism with replicated parameters)" if "Fully" in kind \
            or "fsdp" in type(net).__module__ else "the trainer wraps the net in DistributedDataParallel itself"
        raise ConfigError(f"distributed=DDP() takes the plain module, got a {kind}: {what}; pass the module itself")
    import torch

    for name, module in net.named_modules():
        if isinstance(module, _BATCHNORM):
            raise ConfigError(
                f"distributed=DDP() refuses BatchNorm layers ({name or 'the net'}: {type(module).__name__}): each rank "
                f"would normalise with its own batch statistics and keep its own running stats, so the replicas "
                f"drift apart; {_NORM_ADVICE}")
        if isinstance(module, nn.SyncBatchNorm) and not torch.cuda.is_available():
            raise ConfigError(
                f"distributed=DDP() on CPU refuses SyncBatchNorm layers ({name or 'the net'}): they only run on CUDA "
                f"devices (torch raises 'SyncBatchNorm layers only work with GPU modules' at the first batch) and "
                f"this machine has none; {_NORM_ADVICE}")
    if trainer_step_fn is not None:
        raise ConfigError("distributed=DDP() does not take a trainer_step_fn (its forward would bypass the "
                          "DistributedDataParallel wrapper and the agreed window): use train_step_fn instead")
    if precision == "fp16":
        raise ConfigError("distributed=DDP() does not run precision='fp16' (its GradScaler skips backward per "
                          "rank); use precision='bf16' or 'fp32'")
    return distributed


def is_writer_rank(ddp: DDP) -> bool:
    """Whether this process is ``ddp``'s writer rank: the initialized group's rank, else ``RANK``."""
    import os

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return rank == ddp.writer_rank


@contextmanager
def data_parallel(ddp: DDP | None, net: nn.Module, train_loader: Any, entry: str,
                  val_loader: Any = None) -> Iterator[tuple[World, Any]]:
    """The world of one ``fit`` and the ``DistributedDataParallel`` wrapper of ``net`` the engine runs
    through (None without ``ddp``; see the module docstring).

    Raises:
        ConfigError: without ``ddp``, a group of more than one rank; with it, a train loader
            without a length, ranks whose train loaders have different lengths, or train partitions
            the ranks do not share, or a validation loader that would score some row twice or not
            at all (:func:`_check_one_partition`) -- on every rank.
    """
    if ddp is None:
        refuse_group(entry)
        yield World(), None
        return
    import torch
    from torch.nn.parallel import DistributedDataParallel

    world = ddp.world()
    n = length_of(train_loader)
    if n is None:
        raise ConfigError("distributed=DDP() needs a train loader with a length (every rank must take the same "
                          "number of steps): use nnx_es.distributed.train_loader(dataset, batch_size)")
    counts = world.agree(torch.tensor([float(n), -float(n)], dtype=torch.float64), "max").tolist()
    if counts[0] != -counts[1]:
        raise ConfigError(
            f"the ranks' train loaders have different lengths (from {int(-counts[1])} to {int(counts[0])} batches; "
            f"rank {world.rank} has {n}): every rank must take the same number of steps, or the group hangs; build "
            "them with nnx_es.distributed.train_loader(dataset, batch_size) on the same data set; nothing was trained")
    _check_one_partition(world, train_loader, val_loader, own_partition=ddp.own_partition)
    device_ids = [torch.device(world.device).index] if world.device.startswith("cuda") else None
    # broadcast_buffers=False: no collective per forward (BatchNorm is refused; buffers agree from the start)
    try:
        wrapper = DistributedDataParallel(net, device_ids=device_ids, forward_sync_buffers=False)
    except TypeError:  # a torch before forward_sync_buffers
        wrapper = DistributedDataParallel(net, device_ids=device_ids, broadcast_buffers=False)
    yield world, wrapper


def _partition_of(loader: Any) -> tuple[int | None, int | None, Any]:
    """(rank, world size, what the ranks must share) of a train loader's partition sampler --
    :class:`~nnx_es.distributed.PartitionSampler` or ``DistributedSampler`` -- else Nones."""
    sampler = getattr(loader, "sampler", None)
    describe = getattr(sampler, "describe", None)
    if callable(describe) and isinstance(getattr(sampler, "world_size", None), int):
        return sampler.rank, sampler.world_size, describe()
    from torch.utils.data.distributed import DistributedSampler

    if isinstance(sampler, DistributedSampler):
        shared = {"kind": "DistributedSampler", "rows": len(sampler.dataset), "seed": sampler.seed,  # type: ignore[arg-type]
                  "shuffle": sampler.shuffle, "drop_last": sampler.drop_last}
        return sampler.rank, sampler.num_replicas, shared
    return None, None, None


def _validation_problem(world: World, loader: Any, *, own_partition: bool = False) -> str | None:
    """Why ``loader`` would not score every validation row exactly once over the ranks, else None:
    a training partition (shuffled, padded or cut), a ``DistributedSampler`` that pads or drops,
    a shard built for another rank or world size, or no shard at all (a plain ``DataLoader``, a
    list of batches: every rank would score every row) unless ``own_partition`` says the loader
    deals this rank's rows by means of its own."""
    from nnx_es.distributed.global_batch import GlobalBatchSampler
    from nnx_es.distributed.partitions import PartitionSampler, ShardSampler

    if loader is None:
        return None
    sampler = getattr(loader, "sampler", None)
    rank, size = getattr(sampler, "rank", None), getattr(sampler, "world_size", getattr(sampler, "num_replicas", None))
    if not own_partition and not (isinstance(rank, int) and isinstance(size, int)):
        return (f"rank {world.rank}'s validation loader ({_loader_name(loader)}) deals no shard of the rows: every "
                "rank would score every row")
    if isinstance(sampler, PartitionSampler):
        return (f"rank {world.rank}'s validation loader deals a training partition (policy={sampler.policy!r}: "
                "rows repeated or left out)")
    if isinstance(sampler, GlobalBatchSampler):
        return f"rank {world.rank}'s validation loader deals training global batches (an epoch's tail left out)"
    if isinstance(sampler, ShardSampler) and (sampler.rank, sampler.world_size) != (world.rank, world.size):
        return (f"rank {world.rank}'s validation loader is built for rank {sampler.rank} of "
                f"world_size={sampler.world_size}")
    from torch.utils.data.distributed import DistributedSampler

    if isinstance(sampler, DistributedSampler):
        rows = len(sampler.dataset)  # type: ignore[arg-type]
        if rows % sampler.num_replicas:
            left = rows % sampler.num_replicas
            how = f"leaves out {left}" if sampler.drop_last else f"scores {sampler.num_replicas - left} twice"
            return (f"rank {world.rank}'s validation loader is a DistributedSampler over {rows} rows and "
                    f"{sampler.num_replicas} ranks: it {how}")
    return None


def _loader_name(loader: Any) -> str:
    """A train loader as a message names it: its type, and a DataLoader's sampler and row count."""
    sampler = getattr(loader, "sampler", None)
    if sampler is None:
        return f"a {type(loader).__name__}"
    dataset = getattr(loader, "dataset", None)
    try:
        rows = f" over {len(dataset)} rows" if dataset is not None else ""  # type: ignore[arg-type]
    except TypeError:
        rows = ""
    return f"a {type(loader).__name__} with a {type(sampler).__name__}{rows}"


def _check_one_partition(world: World, train_loader: Any, val_loader: Any = None, *,
                         own_partition: bool = False) -> None:
    """Refuse, on every rank alike, train partitions that are not one partition of the group's rows,
    and a validation loader that would not score every row exactly once.

    Every rank taking the same number of steps is not enough: a loader seeded per rank
    (``seed=rank``), or built for another rank or world size, deals rows that overlap and rows
    that no rank reads, and the run would complete on them. Validation sums are all-reduced, so
    a padded validation partition (``DistributedSampler``, a ``train_loader``) counts its repeated
    rows twice in every metric. One gather of each rank's ``(rank, world size, description,
    validation problem)``; the message is built from all of them, so it is the same on every rank.

    A train loader with no partition sampler on any rank (a plain ``DataLoader``, a list of
    batches) deals every rank the same rows unless it shards them by means of its own: refused
    unless ``own_partition`` (``DDP(own_partition=True)``) says so.

    Raises:
        ConfigError: a rank's sampler names another rank or world size than the group's, the
            ranks' descriptions (rows, policy, seed, shuffle) differ, no rank's train loader deals
            a partition (without ``own_partition``), or a validation loader repeats or leaves out
            rows (use :func:`~nnx_es.distributed.validation_loader`).
    """
    mine = _partition_of(train_loader)
    ranks = world.gather([world.rank, *mine, _validation_problem(world, val_loader, own_partition=own_partition),
                          _loader_name(train_loader)])
    bad_val = [r[4] for r in ranks if r[4] is not None]
    if bad_val:
        raise ConfigError(
            f"the validation loaders would not score every row exactly once ({'; '.join(bad_val)}): the agreed "
            "metrics would count some rows twice or miss them; build every rank's with "
            "nnx_es.distributed.validation_loader(dataset, batch_size) (rows rank::world, unpadded), or, if each "
            "rank's loader already holds its own rows, say so with DDP(own_partition=True); nothing was trained")
    if all(r[3] is None for r in ranks):
        if own_partition:
            return  # DDP(own_partition=True): a loader of the user's own that shards (its lengths were checked)
        names = sorted({r[5] for r in ranks})
        raise ConfigError(
            f"the train loader ({'; '.join(names)}) deals no partition of the rows to the {world.size} ranks: every "
            f"rank would train on the same rows -- duplicated work and a global batch of {world.size} copies of one "
            "batch; build every rank's with nnx_es.distributed.train_loader(dataset, batch_size, seed=S) (or a "
            "DataLoader over a torch.utils.data.DistributedSampler); if your loader already deals each rank its own "
            "rows (a sampler or IterableDataset of yours), say so with DDP(own_partition=True); nothing was trained")
    wrong = [f"rank {r[0]}'s is built for rank {r[1]} of world_size={r[2]}" for r in ranks
             if r[3] is not None and (r[1], r[2]) != (r[0], world.size)]
    kinds = {repr(r[3]) for r in ranks}
    if wrong or len(kinds) > 1:
        why = "; ".join(wrong) if wrong else "the ranks' partitions differ: " + "; ".join(
            f"rank {r[0]}: {r[3]}" for r in ranks)
        raise ConfigError(
            f"the ranks' train loaders do not deal one partition of the rows ({why}): rows would overlap and some "
            f"go unread; build every rank's with nnx_es.distributed.train_loader(dataset, batch_size, seed=S) -- the "
            f"same data set, policy and seed on every rank, rank and world_size left to the group "
            f"({world.size} ranks); nothing was trained")
    _check_records_unpadded(world, train_loader, mine[2])


def _check_records_unpadded(world: World, train_loader: Any, shared: Any) -> None:
    """Refuse per-row records (a :class:`~nnx_es.rows.RowIdDataset`) over a partition that pads: its
    repeated rows would be trained twice in an epoch, which a record keyed by ``(row id, epoch)``
    refuses at the epoch's close (:mod:`nnx_es.rows.recorder`) -- refused here, before anything is
    written, alike on every rank (``shared``: the partition the ranks agreed on).

    Raises:
        ConfigError: naming the rows, the world size and what to use instead.
    """
    from nnx_es.rows.dataset import RowIdDataset

    if not isinstance(shared, dict) or not isinstance(getattr(train_loader, "dataset", None), RowIdDataset):
        return
    rows = shared.get("rows")
    pads = shared.get("policy") == "pad" or (shared.get("kind") == "DistributedSampler" and not shared["drop_last"])
    if pads and isinstance(rows, int) and rows % world.size:
        twice = world.size - rows % world.size
        raise ConfigError(
            f"the train partition pads {rows} rows to a multiple of {world.size} ranks, so {twice} "
            f"row{'s' if twice != 1 else ''} would be trained twice each epoch, but the batches carry row ids (with_row_ids) and a per-row "
            "record is one row's once an epoch: use nnx_es.distributed.train_loader(dataset, batch_size, "
            "policy='drop') (or DistributedSampler(drop_last=True)), or a row count the world size divides; "
            "nothing was trained")


def evaluation_world(loader: Any, net: nn.Module | None = None, entry: str = "NNModel.evaluate", *,
                     writer_rank: int = 0) -> World | None:
    """The world a standalone evaluation of ``loader`` agrees its sums over, or ``None`` (one process).

    Inside an initialized process group of more than one rank the evaluation is a collective:
    every rank scores the rows its loader gives it and the sums are all-reduced once, so every
    rank returns the whole set's metrics (each rank's shard alone was a silent wrong answer).
    Every rank must call it. A loader that would score some row twice over the ranks (a padded
    ``DistributedSampler``, a training partition, a shard built for another rank) is refused on
    every rank alike. The agreed sums are only one model's if every rank holds the same weights:
    with ``net``, each rank's :func:`~nnx_es.distributed.digest.params_digest` rides in the same
    gather, and weights that differ from ``writer_rank``'s (a writer that loaded BEST while the
    others kept their last weights) are refused on every rank alike -- the metrics would mix
    models silently. One gather of each rank's ``(problem, digest)``; the message is built from
    all of them, so it is the same on every rank.

    Without a group, a loader built as one rank's share of several (``validation_loader`` /
    ``train_loader`` under ``WORLD_SIZE`` > 1, a ``DistributedSampler``) is refused: its metrics
    would be that share's.

    Raises:
        ConfigError: as above; the message names the loader and what to use.
        DivergenceError: in a group, ranks whose ``net`` differs from ``writer_rank``'s (named,
            with what to do); nothing was scored.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        world = DDP(writer_rank=writer_rank).world()
        digest = params_digest(net) if net is not None else None
        ranks = world.gather((_validation_problem(world, loader), digest))
        problems = [p for p, _ in ranks if p is not None]
        if problems:
            raise ConfigError(
                f"{entry} inside a group of {world.size} ranks agrees the ranks' sums, but the loaders would not "
                f"score every row exactly once ({'; '.join(problems)}); build every rank's with "
                "nnx_es.distributed.validation_loader(dataset, batch_size) (rows rank::world, unpadded)")
        apart = ranks_apart([d for _, d in ranks], world.writer_rank)
        if apart:
            raise DivergenceError(
                f"{entry} inside a group of {world.size} ranks: rank(s) {apart} hold weights that differ from the "
                f"writer rank {world.writer_rank}'s, so the agreed metrics would mix different models; load the same "
                "weights on every rank before evaluating (e.g. model.load(run_dir, 'best') on every rank -- the run "
                "directory on storage every rank reads -- not on the writer alone), or evaluate from one process "
                "without torchrun; nothing was scored")
        return world
    sampler = getattr(loader, "sampler", None)
    from torch.utils.data.distributed import DistributedSampler

    share = getattr(sampler, "world_size", None) if not isinstance(sampler, DistributedSampler) else \
        sampler.num_replicas
    if isinstance(share, int) and share > 1 and (isinstance(sampler, DistributedSampler)
                                                 or callable(getattr(sampler, "describe", None))):
        raise ConfigError(
            f"{entry}: the loader ({_loader_name(loader)}) deals rank {getattr(sampler, 'rank', '?')}'s share of "
            f"{share} ranks, but no process group of several ranks is initialized to gather the others' sums: "
            "the metrics would be that share's alone; evaluate on every rank inside the group (the process group "
            "torchrun started: DDP().world()), or pass a loader over the whole data set here")
    return None

"""How a ``fit`` enters data parallelism: the checks made at construction, and the per-fit wrapper.

:func:`check_distributed` refuses, when the trainer is built, what this data-parallel path
does not execute (each refusal names what to do instead). :func:`data_parallel` is the
context of one ``fit``: it joins the process group (:meth:`DDP.world`), checks that every
rank takes the same number of steps, wraps the net in ``DistributedDataParallel`` for the
update engine -- the net itself is never replaced, so checkpoints hold its own keys (no
``module.`` prefix) -- and unwraps it when the fit ends. Without ``DDP`` it refuses a
process that is one of several ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from nnx_es.distributed.group import DDP, refuse_group
from nnx_es.errors import ConfigError
from nnx_es.loaders import length_of
from nnx_es.run_state import World

__all__ = ["check_distributed", "data_parallel", "is_writer_rank", "refuse_unagreed_metrics"]

_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d,
              nn.LazyBatchNorm3d)


def check_distributed(distributed: Any, net: nn.Module, *, trainer_step_fn: Any = None,
                      precision: str = "fp32") -> DDP | None:
    """Validate ``Trainer(distributed=...)`` against the net and the trainer's settings.

    Raises:
        ConfigError: not a :class:`DDP`; a net already wrapped (DDP, FSDP); a BatchNorm layer (its
            statistics would differ per rank: convert to ``SyncBatchNorm`` or remove it); a
            ``trainer_step_fn`` or ``precision="fp16"`` (not executed under DDP yet).
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
    for name, module in net.named_modules():
        if isinstance(module, _BATCHNORM):
            raise ConfigError(
                f"distributed=DDP() refuses BatchNorm layers ({name or 'the net'}: {type(module).__name__}): each rank "
                "would normalise with its own batch statistics and keep its own running stats, so the replicas "
                "drift apart; convert them with torch.nn.SyncBatchNorm.convert_sync_batchnorm(net) or remove them")
    if trainer_step_fn is not None:
        raise ConfigError("distributed=DDP() does not take a trainer_step_fn (its forward would bypass the "
                          "DistributedDataParallel wrapper and the agreed window): use train_step_fn instead")
    if precision == "fp16":
        raise ConfigError("distributed=DDP() does not run precision='fp16' (its GradScaler skips backward per "
                          "rank); use precision='bf16' or 'fp32'")
    return distributed


def refuse_unagreed_metrics(metrics: Any) -> None:
    """Refuse user metrics (:mod:`nnx_es.user_metrics`) under DDP: their state is per rank and is not
    agreed yet, so records and a monitor on them would differ between the ranks.

    Raises:
        ConfigError: naming the metric; the loss, its terms and ``"accuracy"`` are agreed.
    """
    from nnx_es.user_metrics import UserMetric

    for m in metrics:
        if isinstance(m, UserMetric):
            raise ConfigError(f"distributed=DDP() does not agree user metric {getattr(m, 'name', m)!r} between the "
                              "ranks yet (its state is per rank: records and a monitor on it would differ); use the "
                              "loss, its terms or 'accuracy' under DDP, or score it after training (NNModel.evaluate)")


def is_writer_rank(ddp: DDP) -> bool:
    """Whether this process is ``ddp``'s writer rank: the initialized group's rank, else ``RANK``."""
    import os

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return rank == ddp.writer_rank


@contextmanager
def data_parallel(ddp: DDP | None, net: nn.Module, engine: Any, train_loader: Any, entry: str) -> Iterator[World]:
    """The world of one ``fit`` (see the module docstring); the engine runs through DDP inside it.

    Raises:
        ConfigError: without ``ddp``, a group of more than one rank; with it, a train loader
            without a length, or ranks whose train loaders have different lengths (every rank).
    """
    if ddp is None:
        refuse_group(entry)
        yield World()
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
    device_ids = [torch.device(world.device).index] if world.device.startswith("cuda") else None
    # broadcast_buffers=False: no collective per forward (BatchNorm is refused; buffers agree from the start)
    try:
        wrapper = DistributedDataParallel(net, device_ids=device_ids, forward_sync_buffers=False)
    except TypeError:  # a torch before forward_sync_buffers
        wrapper = DistributedDataParallel(net, device_ids=device_ids, broadcast_buffers=False)
    engine.use_ddp(wrapper)
    try:
        yield world
    finally:
        engine.use_ddp(None)

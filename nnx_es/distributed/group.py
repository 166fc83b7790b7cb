"""The process group a run trains in: ``DDP()`` reads the launcher's contract; ``shutdown`` ends it.

nnx_es starts no runtime of its own (spec 000 §3, DESIGN.md "Distributed"): ``torchrun``
(or TorchElastic, or any launcher that sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``)
starts the processes. :meth:`DDP.world` reuses a process group that is already
initialized, or initializes one from the environment -- gloo on CPU, nccl with the device
``cuda:LOCAL_RANK`` when CUDA is available -- always with a short timeout, so a dead peer
becomes an error within that bound instead of a hang (gloo's default is 30 minutes).

:func:`shutdown` is the recipe's last call: a bounded barrier every rank must reach, then
the group is destroyed; a rank that does not arrive in time makes the others raise
``RuntimeError``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import structlog

import nnx_es.distributed.elastic as elastic
from nnx_es.errors import ConfigError
from nnx_es.runtime.run_state import World

__all__ = ["DDP", "env_world_size", "refuse_group", "shutdown"]

log = structlog.get_logger("nnx_es")

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} must be an integer (torchrun sets it)") from None


def env_world_size() -> int:
    """The size of the process group this process belongs to: the initialized group's, else
    ``WORLD_SIZE`` from the environment, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return _env_int("WORLD_SIZE") or 1


def refuse_group(entry: str) -> None:
    """Refuse a single-process entry point (``entry``, e.g. ``"Trainer.fit"``) inside a group of
    more than one rank: every rank would write the same run.

    Raises:
        ConfigError: the group has more than one rank; the message says to pass ``distributed=DDP()``.
    """
    size = env_world_size()
    if size > 1:
        raise ConfigError(
            f"{entry} runs a single process, but this process is one of {size} ranks (WORLD_SIZE / an "
            "initialized process group): every rank would train and write the same run alone; pass "
            "distributed=nnx_es.distributed.DDP() to train them as one data-parallel run")


@dataclass(frozen=True)
class DDP:
    """Data parallelism over the ranks ``torchrun`` started (``Trainer(distributed=DDP())``).

    Args:
        writer_rank: the rank that holds the lease, appends to the log and writes blobs and
            views (spec 000 §3 "One writer"); the others fold the same events in memory.
        timeout_seconds: the process group's timeout when nnx_es initializes it (also the bound
            of its collectives under gloo): a dead peer is an error after this long, never a hang.
        digest_every: compare a digest of every rank's parameters every N committed updates
            (``None``: at each epoch's end), and once more at the end of training when the last
            comparison was not of the final step; a mismatch stops the run naming the ranks.
        own_partition: the train loaders deal each rank its own rows by means nnx_es cannot
            see (a sampler of your own, an ``IterableDataset`` that shards by rank). Without it,
            a train loader that is neither :func:`~nnx_es.distributed.train_loader` nor a
            ``DataLoader`` over a ``DistributedSampler`` is refused before training on every rank:
            a plain ``DataLoader`` deals every rank the same rows (duplicated work, a global batch
            of ``world_size`` copies). With it, the lengths are still agreed; the rows are yours.

    Raises:
        ConfigError: a bad argument (the message names it, its type when that is wrong, and the
            value), or an environment without a process group and without ``RANK`` /
            ``WORLD_SIZE`` (from :meth:`world`).
    """

    writer_rank: int = 0
    timeout_seconds: float = 60.0
    digest_every: int | None = None
    own_partition: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.own_partition, bool):
            raise ConfigError(f"DDP(own_partition=) must be True or False, got {self.own_partition!r}")
        if isinstance(self.writer_rank, bool) or not isinstance(self.writer_rank, int):
            raise ConfigError(f"DDP(writer_rank=) must be an int (a global rank >= 0), got "
                              f"{type(self.writer_rank).__name__} {self.writer_rank!r}: pass e.g. "
                              f"DDP(writer_rank=0)")
        if self.writer_rank < 0:
            raise ConfigError(f"DDP(writer_rank=) must be a rank >= 0, got {self.writer_rank!r}")
        if isinstance(self.timeout_seconds, bool) or not isinstance(self.timeout_seconds, (int, float)) \
                or not self.timeout_seconds > 0:
            raise ConfigError(f"DDP(timeout_seconds=) must be a number of seconds > 0, got {self.timeout_seconds!r}")
        if self.digest_every is not None and (isinstance(self.digest_every, bool) or not isinstance(
                self.digest_every, int) or self.digest_every < 1):
            raise ConfigError(f"DDP(digest_every=) must be a number of committed updates >= 1 or None (each epoch's "
                              f"end), got {self.digest_every!r}")

    def world(self) -> World:
        """This process's :class:`~nnx_es.runtime.run_state.World`, initializing the process group if needed.

        Reuses an initialized group (its rank and size); otherwise reads ``RANK``,
        ``WORLD_SIZE``, ``LOCAL_RANK`` (and ``MASTER_ADDR``/``MASTER_PORT``, through the
        ``env://`` rendezvous) and initializes gloo (CPU) or nccl (CUDA, device
        ``cuda:LOCAL_RANK``) with ``timeout_seconds`` -- under torchrun's agent store in a
        namespace of each restarted generation's own (:mod:`nnx_es.distributed.elastic`).

        Raises:
            ConfigError: no group and no launcher environment, or ``writer_rank`` >= the size.
        """
        import torch
        import torch.distributed as dist

        if not dist.is_available():
            raise ConfigError("DDP(): this torch build has no torch.distributed")
        local_rank = _env_int("LOCAL_RANK") or 0
        cuda = torch.cuda.is_available()
        if not dist.is_initialized():
            rank, size = _env_int("RANK"), _env_int("WORLD_SIZE")
            if rank is None or size is None:
                raise ConfigError(
                    "DDP(): no process group is initialized and RANK / WORLD_SIZE are not set: start the script "
                    "with torchrun (e.g. torchrun --standalone --nproc_per_node=2 train.py), or call "
                    "torch.distributed.init_process_group first")
            if cuda:
                torch.cuda.set_device(local_rank)
            # restart-safe under torchrun --max-restarts: each generation rendezvouses in its own
            # namespace of the agent's store (nnx_es.distributed.elastic)
            elastic.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size,
                                       timeout=datetime.timedelta(seconds=float(self.timeout_seconds)))
            log.info("process group initialized", rank=rank, world_size=size, backend=dist.get_backend())
        rank, size = int(dist.get_rank()), int(dist.get_world_size())
        if self.writer_rank >= size:
            raise ConfigError(f"DDP(writer_rank={self.writer_rank}) is not a rank of this group of {size} ranks "
                              f"(0..{size - 1})")
        device = f"cuda:{local_rank}" if dist.get_backend() == "nccl" else "cpu"
        return World(rank=rank, size=size, writer_rank=self.writer_rank, device=device)

    @property
    def device(self) -> str | None:
        """The device this rank trains on: ``cuda:LOCAL_RANK`` when CUDA is available, else ``None`` (the model's)."""
        import torch

        return f"cuda:{_env_int('LOCAL_RANK') or 0}" if torch.cuda.is_available() else None


def shutdown(timeout_seconds: float = 60.0) -> None:
    """End the process group: every rank meets at a barrier bounded by ``timeout_seconds``, then
    the group is destroyed (spec 000 §3 "Teardown"). No rank tears down its connections while a
    peer still uses them.

    Without a group, or after a successful call, it does nothing. With gloo the wait is gloo's
    ``monitored_barrier`` (it names the ranks that did not arrive); otherwise a barrier, bounded
    by the group's own timeout.

    Raises:
        RuntimeError: a rank did not arrive in time; the group is then left for process exit.
        ConfigError: ``timeout_seconds`` is not > 0.
    """
    if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)) or not timeout_seconds > 0:
        raise ConfigError(f"shutdown(timeout_seconds=) must be a number of seconds > 0, got {timeout_seconds!r}")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    timeout = datetime.timedelta(seconds=float(timeout_seconds))
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        else:
            dist.barrier()
    except Exception as exc:  # gloo raises RuntimeError (or DistBackendError, a RuntimeError) naming the ranks
        raise RuntimeError(f"nnx_es.distributed.shutdown: not every rank reached the teardown barrier within "
                           f"{timeout_seconds} s ({exc}); the process group is left for process exit") from exc
    dist.destroy_process_group()

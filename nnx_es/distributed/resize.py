"""Elastic mode in a fit and at a resume: the window a world size gives, and a run that changes world size.

A run whose train loader is an :func:`~nnx_es.distributed.elastic_loader` (elastic mode) declares
its global batch ``G`` (:mod:`nnx_es.distributed.global_batch`). Then:

* each ``fit`` takes its accumulation window from the loader's plan for the world it trains in
  (:func:`global_batch_accumulation`): ``G / world_size`` rows per rank and update, in
  ``accumulation`` microbatches;
* a stateful resume (or a fork) of an elastic checkpoint may run on another world size that
  divides ``G`` (or another microbatch split) -- the specification's rule for an exact resume
  (spec 000, "Any other resume fails") stays the default for every other run. Every resume
  point is an epoch's end (a LAST captures the epoch's end state, with ``checkpoint_lag`` too),
  so the epochs that remain are re-dealt whole: epoch ``e``'s global batches are cut from
  ``(seed, e)`` alone. Weights, optimizers, schedulers, monitor, callbacks and counters restore
  as they always do (they are the same on every rank); what is per rank -- the RNG streams --
  maps to the new ranks by :func:`successor_streams`; and the run records a
  :class:`~events.schema.WorldChanged` right after its ``run_resumed``.

Refused before anything is restored, on every rank alike (a :class:`~nnx_es.errors.ResumeError`
naming what differs): an elastic resume of a checkpoint that was not trained in elastic mode, or
with another global batch, data set size, seed or shuffling.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from events.schema import WorldChanged
from nnx_es.distributed.global_batch import GlobalBatchSampler
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.runtime.run_state import World

__all__ = ["KEPT", "elastic_topology", "global_batch_sampler", "fit_engine", "global_batch_accumulation", "refuse_elastic_checkpoint",
           "resume_streams", "successor_streams"]

#: what an elastic resume keeps from its checkpoint's deal (another world size and microbatch split may differ)
KEPT = ("global_batch", "rows", "seed", "shuffle")


def global_batch_sampler(loader: Any) -> GlobalBatchSampler | None:
    """The :class:`~nnx_es.distributed.global_batch.GlobalBatchSampler` of an elastic train loader, else None."""
    sampler = getattr(loader, "sampler", None)
    return sampler if isinstance(sampler, GlobalBatchSampler) else None


def elastic_topology(loaders: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a checkpoint records of an elastic run (``topology["elastic"]``): its train loader's deal,
    or None when the run is not elastic (its checkpoints then hold nothing more than before)."""
    sampler = global_batch_sampler(loaders.get("train"))
    return sampler.describe() if sampler is not None else None


def global_batch_accumulation(accumulation: int, world: World, train_loader: Any) -> int | None:
    """For one ``fit``: the accumulation window an elastic train loader deals on ``world`` (its plan's
    microbatches per rank and update), or None when the loader is not elastic. ``accumulation``: the
    trainer's own window, which must be 1 (the global batch sets it).

    Raises:
        ConfigError: on every rank alike, when the trainer already has a window of its own
            (``Trainer(accumulation=)`` or a ``GradientAccumulation`` hook: the global batch sets it),
            or the loader was built for another rank or world size than the fit's.
    """
    sampler = global_batch_sampler(train_loader)
    if sampler is None:
        return None
    plan = sampler.plan
    mine = None
    if accumulation != 1:
        mine = (f"this trainer accumulates {accumulation} microbatches per update (Trainer(accumulation=) or a "
                f"GradientAccumulation hook), but an elastic_loader sets the window itself: global_batch="
                f"{plan.global_batch} on {world.size} rank(s) is {plan.accumulation} microbatch(es) of "
                f"{plan.microbatch_rows} rows per rank; drop accumulation= (declare elastic_loader(..., microbatch=) "
                "to cap the rows of a forward)")
    elif (sampler.rank, sampler.world_size) != (world.rank, world.size):
        mine = (f"the elastic_loader was built for rank {sampler.rank} of {sampler.world_size}, but this process is "
                f"rank {world.rank} of {world.size}: build it after joining the group (DDP().world()), with rank "
                "and world_size left to the group")
    if world.agree_flag(mine is not None):  # the same refusal on every rank: none goes on into a collective
        why = [w for w in world.gather(mine) if w is not None]
        raise ConfigError(f"{why[0]}; nothing was trained")
    return int(plan.accumulation)


def fit_engine(engine: Any, world: World, train_loader: Any) -> Any:
    """The update engine of one ``fit``: ``engine`` itself, or (an elastic train loader) ``engine``
    with the loader's window on ``world`` (:func:`global_batch_accumulation`, which raises)."""
    window = global_batch_accumulation(engine.accumulation, world, train_loader)
    return engine if window is None else engine.under(None, accumulation=window)


def _fresh_streams(donor: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """The RNG streams of a rank the checkpoint had no streams for: ``donor``'s layout (its loaders'
    generators as they are), torch's, NumPy's and Python's global streams seeded by the first 8 bytes
    of SHA-256(donor's torch stream, ``rank``) -- a function of the checkpoint alone."""
    import random

    import numpy as np
    import torch

    from nnx_es.rng import capture_rng, restore_rng

    digest = hashlib.sha256(bytes(donor["torch"]) + int(rank).to_bytes(8, "little")).digest()
    seed = int.from_bytes(digest[:8], "little")
    saved = capture_rng({})
    try:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        fresh = capture_rng({})
    finally:
        restore_rng(saved, {})
    return {**donor, "torch": fresh["torch"], "numpy": fresh["numpy"], "python": fresh["python"]}


def successor_streams(streams: Sequence[Mapping[str, Any]], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s RNG streams after a resume of a checkpoint holding ``streams`` (old rank ``i``'s
    at index ``i``), on any world size. The rule:

    * a rank the checkpoint had (``rank < len(streams)``) goes on with its own streams exactly, as a
      resume on the same world size does (spec 000 §3);
    * a new rank (``rank >= len(streams)``) starts fresh torch / NumPy / Python global streams seeded
      from SHA-256 of old rank ``rank mod len(streams)``'s torch stream and ``rank``: distinct from
      every other rank's and from its donor's, the same for every resume of that checkpoint; its
      loaders' own generators (if any) are the donor's;
    * the streams of old ranks the new world does not have end there.

    Dropout then draws independent masks on every rank, matching one process in distribution only,
    as it does across ranks without a world change.
    """
    if rank < len(streams):
        return dict(streams[rank])
    return _fresh_streams(streams[rank % len(streams)], rank)


def resume_streams(run: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's RNG streams for an elastic resume of the checkpoint ``state`` into ``run`` (a
    :class:`~nnx_es.snapshot.RunComponents` whose train loader is elastic), after checking that the
    checkpoint is an elastic run's with the same global batch, rows, seed and shuffling; when the
    world size or the microbatch split changed, ``run.notes`` gets the :class:`~events.schema.WorldChanged`
    the run records after its opening.

    Raises:
        ResumeError: the checkpoint was not trained in elastic mode, or its deal keeps another
            :data:`KEPT` value (named), or its streams do not match its world size; nothing is restored.
    """
    sampler = global_batch_sampler(run.loaders.get("train"))
    assert sampler is not None, "resume_streams needs an elastic train loader"
    topology = state.get("topology") or {}
    old = int(topology.get("world_size", 1) or 1)
    recorded = topology.get("elastic")
    mine = sampler.describe()
    if not isinstance(recorded, dict):
        raise ResumeError(
            f"the checkpoint was trained on {old} rank(s) without elastic mode (its train loader was not an "
            "elastic_loader), so its updates were not cut from a declared global batch and cannot continue on "
            f"another deal; resume it with the loaders it was trained with (on {old} rank(s)), or use "
            "resume_mode='weights_only' to start a new run from its weights; nothing was restored")
    differ = [f"{k} {recorded.get(k)!r} -> {mine[k]!r}" for k in KEPT if recorded.get(k) != mine[k]]
    if differ:
        raise ResumeError(
            f"an elastic resume keeps the run's global batch, rows and order, but this train loader differs from "
            f"the checkpoint's: {', '.join(differ)}; build it with elastic_loader(dataset, global_batch="
            f"{recorded.get('global_batch')!r}, seed={recorded.get('seed')!r}, shuffle={recorded.get('shuffle')!r}) "
            f"over the same {recorded.get('rows')!r} rows (any world size dividing the global batch, any "
            "microbatch), or use resume_mode='weights_only'; nothing was restored")
    streams = (state.get("ranks") or {}).get("rng") or [state["rng"]]
    if len(streams) != old:
        raise ResumeError(f"the checkpoint holds the RNG streams of {len(streams)} rank(s) but says it was trained on "
                          f"{old}: it is not one this version wrote; nothing was restored")
    plan, world = sampler.plan, run.world
    if (old, recorded.get("microbatch_rows"), recorded.get("accumulation")) != (
            world.size, plan.microbatch_rows, plan.accumulation):
        data = state.get("data") or {}
        run.notes = [WorldChanged(
            old=old, new=world.size, global_batch=plan.global_batch, epoch=int(data.get("next_epoch", 0)),
            rows_per_rank=plan.rows_per_rank, microbatch_rows=plan.microbatch_rows, accumulation=plan.accumulation,
            global_batches=sampler.n // plan.global_batch, streams_kept=min(old, world.size))]
    return successor_streams(streams, world.rank)


def refuse_elastic_checkpoint(topology: Mapping[str, Any]) -> None:
    """Refuse a resume that is not elastic of a checkpoint an elastic run wrote (its updates were cut
    from a declared global batch; a plain loader would deal other batches of other sizes).

    Raises:
        ResumeError: ``topology`` records an elastic deal (named, with the loader to build).
    """
    recorded = topology.get("elastic")
    if isinstance(recorded, dict):
        raise ResumeError(
            f"the checkpoint is an elastic run's (global_batch={recorded.get('global_batch')!r}, seed="
            f"{recorded.get('seed')!r}, shuffle={recorded.get('shuffle')!r}), but this train loader is not an "
            "elastic_loader: build it with nnx_es.distributed.elastic_loader(dataset, global_batch="
            f"{recorded.get('global_batch')!r}, seed={recorded.get('seed')!r}), or use "
            "resume_mode='weights_only' to start a new run from its weights; nothing was restored")

"""What a stateful resume requires of its loaders: the run's epoch geometry, and workers it can re-seed.

``run_started.loaders`` records each loader's :class:`~events.schema.LoaderGeometry` (batch
size, batches per epoch, ``drop_last``, dataset length) by role, ``"train"`` and ``"val"``.
A stateful resume continues the run's counters and schedules epoch by epoch: with another
batch size the steps per epoch change mid-run (an update-clock schedule, a phase cadence,
the examples an epoch counts), so :func:`check_same_loaders` refuses it before anything is
restored, as another optimizer is refused, naming the old and the new values. It also
refuses ``persistent_workers=True`` loaders whose workers' RNG streams cannot be re-seeded
per epoch (:func:`nnx_es.workers.worker_seeding_refusal`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from events.schema import LoaderGeometry
from nnx_es.errors import ResumeError
from nnx_es.workers import worker_seeding_refusal

__all__ = ["length_of", "check_same_loaders", "geometry_mismatch", "loader_geometries", "loader_geometry"]

_FIELDS = ("batch_size", "batches_per_epoch", "drop_last", "dataset_length")
_ROLES = {"train": "train loader", "val": "validation loader"}


def length_of(obj: Any) -> int | None:
    """``len(obj)``, or None when it has none (an IterableDataset's loader raises TypeError there)."""
    try:
        return len(obj)
    except (TypeError, NotImplementedError):  # no __len__, or an IterableDataset's loader without one
        return None


def loader_geometry(loader: Any) -> LoaderGeometry:
    """``loader``'s geometry: what a ``DataLoader`` (or any iterable with ``__len__``) says, None elsewhere."""
    batch_size = getattr(loader, "batch_size", None)
    drop_last = getattr(loader, "drop_last", None)
    dataset = getattr(loader, "dataset", None)
    return LoaderGeometry(
        batch_size=batch_size if isinstance(batch_size, int) and not isinstance(batch_size, bool) else None,
        batches_per_epoch=length_of(loader),
        drop_last=drop_last if isinstance(drop_last, bool) else None,
        dataset_length=length_of(dataset) if dataset is not None else None,
    )


def loader_geometries(loaders: Mapping[str, Any]) -> dict[str, LoaderGeometry]:
    """Role -> :func:`loader_geometry` of each loader given (a ``None`` loader is left out)."""
    return {role: loader_geometry(loader) for role, loader in loaders.items() if loader is not None}


def geometry_mismatch(old: Mapping[str, LoaderGeometry], new: Mapping[str, LoaderGeometry], *,
                      fields: tuple[str, ...] = _FIELDS) -> str | None:
    """How ``new`` differs from ``old`` (role -> geometry): the first role both hold whose
    geometry differs in ``fields``, each differing field named with its old and new value; None when alike.
    A role only one side holds (a validation loader added or left out) is not compared."""
    for role in old.keys() & new.keys():
        before, after = old[role], new[role]
        changed = [f"{f} {getattr(before, f)!r} -> {getattr(after, f)!r}" for f in fields
                   if getattr(before, f) != getattr(after, f)]
        if changed:
            return f"the {_ROLES.get(role, role)}'s geometry differs from the run's: {', '.join(changed)}"
    return None


def check_same_loaders(run_id: str, recorded: Mapping[str, LoaderGeometry] | None, loaders: Mapping[str, Any]) -> None:
    """Refuse a stateful resume of run ``run_id`` with ``loaders`` (role -> loader or None)
    that would not continue it exactly. ``recorded``: the run's ``run_started.loaders``
    (None: a run recorded before they were, whose geometry is not checked).

    An elastic run (its train loader an ``elastic_loader``) may resume on another world size, where
    every loader's share of the rows differs: its loaders must then hold the run's data sets
    (``dataset_length``); the deal itself is checked against the checkpoint's
    (:func:`nnx_es.distributed.resize.resume_streams`).

    Raises:
        ResumeError: a loader's geometry differs from the run's (:func:`geometry_mismatch`),
            or a ``persistent_workers=True`` loader's workers cannot be re-seeded per epoch.
    """
    from nnx_es.distributed.resize import global_batch_sampler

    why = worker_seeding_refusal(dict(loaders))
    if why is None and recorded is not None:
        elastic = global_batch_sampler(loaders.get("train")) is not None
        why = geometry_mismatch(recorded, loader_geometries(loaders),
                                fields=("dataset_length",) if elastic else _FIELDS)
        if why is not None:
            why += ("; the steps per epoch, and every schedule counted in them, would change mid-run: build the "
                    "loaders as the run did, or use resume_mode='weights_only' to start a new run")
    if why is not None:
        raise ResumeError(f"cannot resume run {run_id!r} statefully: {why}; nothing was restored or written")

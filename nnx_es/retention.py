"""Checkpoint retention: which stored checkpoints no kept pointer needs any more.

A run keeps, by default, what a user needs to resume and to load BEST: the newest LAST's
checkpoint and BEST's (``Trainer(keep_last=1, keep_best=True)``), plus the phase checkpoints
``keep_phases`` keeps. Every other checkpoint a LAST once named is pruned in the commit group
of the LAST that superseded it: a ``checkpoint_pruned`` event names it (and the blobs deleted
with it) in the same synced write as that LAST, and the bytes are deleted only after that
write -- so a crash can leave pruned bytes behind, never a pointer without its bytes. The audit
tells blobs gone on purpose (pruned) from blobs missing (a violation). Issue: "Runs that stay
small and fast at scale".

The decision is a pure function of the checkpoints projection
(:class:`projections.checkpoints.CheckpointsState`): :func:`prunable`.
"""

from __future__ import annotations

from projections.checkpoints import CheckpointsState

from nnx_es.errors import ConfigError

__all__ = ["check_retention", "prunable"]


def check_retention(keep_last: int | None, keep_best: bool) -> None:
    """Refuse a retention setting by name.

    Raises:
        ConfigError: ``keep_last`` is neither an int >= 1 nor None; ``keep_best`` is not a bool.
    """
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ConfigError(f"keep_last must be an int >= 1 (checkpoints of the newest LASTs kept) or None (keep "
                          f"every one), got {keep_last!r}")
    if not isinstance(keep_best, bool):
        raise ConfigError(f"keep_best must be True or False, got {keep_best!r}")


def prunable(pointers: CheckpointsState, *, keep_last: int | None, keep_best: bool) -> list[tuple[str, int, str]]:
    """``(manifest, epoch, reason)`` of every stored checkpoint that no kept pointer needs, oldest first.

    Kept: the newest ``keep_last`` checkpoints LASTs named (all of them when ``None``), LAST's
    own, BEST's when ``keep_best``, and every phase checkpoint the phase rotation keeps.
    """
    if keep_last is None:
        return []
    stored = list(pointers.stored.items())
    keep = {m for m, _ in stored[-keep_last:]}
    if pointers.last is not None:
        keep.add(pointers.last.manifest)
    if keep_best and pointers.best is not None:
        keep.add(pointers.best.manifest)
    keep.update(p.manifest for p in pointers.phases.values())
    reason = f"keep_last={keep_last}" + ("" if keep_best else ", keep_best=False")
    return [(m, e, reason) for m, e in stored if m not in keep]

"""Opening a run for writing: a new run, a stateful resume, or a weights-only continuation.

The writer lease is held for the whole session; stale temporaries a hard kill
left are cleaned and reported; a stateful resume verifies its LAST before
anything is restored (:mod:`nnx_es.resume`) and records the discarded tail.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import structlog
import torch

from events.log import LmdbLog
from events.schema import RunResumed, RunStarted, SourceRef
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.lifecycle import Lifecycle
from nnx_es.recorder import Recorder
from nnx_es.resume import find_resume_point
from nnx_es.rng import seed_everything
from nnx_es.snapshot import apply_state, load_state
from nnx_es.storage import BlobStore, Lease, clean_stale_temporaries, validate_run_id

if TYPE_CHECKING:
    from nnx_es.trainer import Trainer

__all__ = ["open_session"]

log = structlog.get_logger("nnx_es")


def _library_versions() -> dict[str, str]:
    import lmdb
    import transitions

    import nnx_es

    return {
        "nnx_es": getattr(nnx_es, "__version__", "0"),
        "torch": str(torch.__version__),
        "msgspec": msgspec.__version__,
        "lmdb": lmdb.__version__,
        "transitions": transitions.__version__,
    }



@contextmanager
def open_session(
    trainer: Trainer, resume_from: str | Path | None, resume_mode: str
) -> Iterator[tuple[RunStarted | RunResumed, int]]:
    """Hold the lease and the open log of ``trainer``'s run; yield (opening event, first epoch).

    Sets ``trainer.run_id``, ``run_dir``, ``runs_root``, ``store`` and ``recorder``.

    Raises:
        ConfigError / ResumeError / LeaseHeldError: see :meth:`nnx_es.Trainer.fit`.
    """
    if resume_mode not in ("stateful", "weights_only"):
        raise ConfigError(f"resume_mode must be 'stateful' or 'weights_only', got {resume_mode!r}")
    stateful = resume_from is not None and resume_mode == "stateful"
    if stateful:
        source = Path(resume_from)  # type: ignore[arg-type]
        if trainer.run_id not in (None, source.name):
            raise ConfigError(
                f"a stateful resume continues run {source.name!r}; run_id={trainer.run_id!r} names another run "
                "(use resume_mode='weights_only' to start a new run from its weights)"
            )
        trainer.runs_root, run_id = source.parent, validate_run_id(source.name)
    else:
        run_id = trainer.run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    trainer.run_id = run_id
    run_dir = trainer.runs_root / run_id
    trainer.run_dir = run_dir
    lease = Lease(trainer.runs_root, run_id).acquire()
    try:
        has_log = (run_dir / "events.lmdb" / "data.mdb").exists()
        if stateful and not has_log:
            raise ResumeError(f"cannot resume {run_dir}: it has no event log")
        if not stateful and has_log:
            raise ConfigError(
                f"run {run_id!r} already has an event log at {run_dir}; a new run or a weights_only "
                f"continuation writes its own run: continue this one with fit(..., resume_from="
                f"{str(run_dir)!r}), choose another run_id, or delete {str(run_dir)!r} to start it over "
                "(a run has nothing to resume until its first LAST commit)"
            )
        removed = clean_stale_temporaries(run_dir)
        if removed:
            log.warning("removed stale temporaries", run_id=run_id, files=[str(p) for p in removed])
        trainer.store = BlobStore(run_dir / "blobs")
        with LmdbLog(run_dir / "events.lmdb") as event_log:
            seed_everything(trainer.seed)
            if stateful:
                point = find_resume_point(run_dir, event_log, expect_run_id=run_id)
                _check_same_recipe(trainer, point.started)
                apply_state(trainer, load_state(trainer.store, point.manifest))
                stop = point.projections.status.stop_reason
                if stop is not None and stop != "update_boundary":
                    # the run had decided to stop (early stopping): resuming finishes it, trains nothing more
                    trainer._request_stop(stop, "resume")
                trainer.recorder = Recorder(event_log, Lifecycle(point.state), counters=point.manifest.counters)
                trainer.committer.phases = list(point.projections.checkpoints.phases)
                opening: RunStarted | RunResumed = RunResumed(
                    last_seq=point.last_seq, manifest=point.manifest_hash, epoch=point.manifest.epoch,
                    discard_from=point.discard_from, discard_to=point.discard_to,
                    library_versions=_library_versions(), callbacks=[cb.name for cb in trainer.callbacks],
                    cleaned_temporaries=len(removed), wall_time_s=time.time(),
                )
                start_epoch = point.manifest.epoch + 1
            else:
                src = None
                if resume_from is not None:
                    src = _load_weights_from(trainer, Path(resume_from))
                trainer.recorder = Recorder(event_log)
                opening = _run_started(trainer, src)
                start_epoch = 0
            yield opening, start_epoch
    finally:
        lease.release()


def _check_same_recipe(trainer: Trainer, started: RunStarted | None) -> None:
    """A stateful resume continues the same recipe: optimizers, schedulers, monitor and window.

    Raises:
        ResumeError: naming what differs from the run's ``run_started`` declaration.
    """
    if started is None:
        return
    mine = _run_started(trainer, None)
    for field, label in (("optimizers", "optimizers"), ("schedulers", "schedulers"), ("monitor", "monitor"),
                         ("accumulation", "accumulation window")):
        theirs, ours = getattr(started, field), getattr(mine, field)
        if theirs != ours:
            raise ResumeError(
                f"cannot resume run {started.run_id!r} statefully with a different {label}: the run declared "
                f"{theirs!r}, this trainer has {ours!r} (use resume_mode='weights_only' to start a new run)"
            )


def _load_weights_from(trainer: Trainer, source: Path) -> SourceRef:
    """Load the model weights of ``source``'s verified LAST into ``trainer``; return the source reference."""
    if source.resolve() == (trainer.runs_root / (trainer.run_id or "")).resolve():
        raise ConfigError(f"a weights_only continuation must write its own run, not its source {source}")
    if not (source / "events.lmdb" / "data.mdb").exists():
        raise ResumeError(f"cannot start from {source}: it has no event log")
    with LmdbLog(source / "events.lmdb", readonly=True) as src_log:
        point = find_resume_point(source, src_log)
    apply_state(trainer, load_state(BlobStore(source / "blobs"), point.manifest), weights_only=True)
    return SourceRef(run_id=point.run_id, last_seq=point.last_seq, manifest=point.manifest_hash)


def _run_started(trainer: Trainer, source: SourceRef | None) -> RunStarted:
    return RunStarted(
        run_id=trainer.run_id or "", seed=trainer.seed, recipe=trainer.recipe, library_versions=_library_versions(),
        callbacks=[cb.name for cb in trainer.callbacks], optimizers=list(trainer.optimizers),
        schedulers=[s.decl() for s in trainer.schedulers],
        monitor=trainer.monitor.spec if trainer.monitor else None, accumulation=trainer.engine.accumulation,
        source=source, wall_time_s=time.time(),
    )

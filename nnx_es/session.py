"""Opening a run for writing: a new run, a stateful resume, or a weights-only continuation.

The writer lease is held for the whole session; stale temporaries a hard kill
left are cleaned and reported; a stateful resume verifies its LAST before
anything is restored (:mod:`nnx_es.resume`) and records the discarded tail.
An opening refused before the session begins (a bad source, another recipe)
removes the run directory it created itself, so a retry is not blocked by an
empty log; a run directory that existed before is never touched.
"""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import structlog
import torch

from events.log import LmdbLog
from events.schema import RunResumed, RunStarted, SourceRef, UpdateSpec
from nnx_es.checkpoint import Manifest
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.lifecycle import Lifecycle
from nnx_es.loaders import check_same_loaders, loader_geometries
from nnx_es.recorder import Recorder
from nnx_es.resume import find_resume_point
from nnx_es.rng import seed_everything
from nnx_es.snapshot import apply_state, load_state
from nnx_es.storage import BlobStore, Lease, clean_stale_temporaries, validate_run_id
from nnx_es.update_hooks import EMA

if TYPE_CHECKING:
    from nnx_es.trainer import Trainer

__all__ = ["check_epochs", "open_session"]

log = structlog.get_logger("nnx_es")


def check_epochs(epochs: int, start_epoch: int) -> None:
    """Refuse a resume asked to train to fewer epochs than its run already committed (before it restores anything).

    Raises:
        ConfigError: ``epochs`` (counted from the run's start) is below the run's committed epochs.
    """
    if epochs < start_epoch:
        raise ConfigError(f"epochs={epochs} is fewer than the {start_epoch} epochs the run already committed: "
                          f"epochs counts from the run's start (pass epochs >= {start_epoch}); nothing was restored or written")


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
    trainer: Trainer, resume_from: str | Path | None, resume_mode: str, epochs: int
) -> Iterator[tuple[RunStarted | RunResumed, int]]:
    """Hold the lease and the open log of ``trainer``'s run; yield (opening event, first epoch).

    ``epochs``: the ``fit`` call's, counted from the run's start (a resume to fewer than the
    run committed is refused before anything is restored).

    Sets ``trainer.run_id``, ``run_dir``, ``runs_root``, ``store`` and ``recorder``.

    Raises:
        ConfigError / ResumeError / LeaseHeldError: see :meth:`nnx_es.Trainer.fit`.
    """
    if resume_mode not in ("stateful", "weights_only"):
        raise ConfigError(f"resume_mode must be 'stateful' or 'weights_only', got {resume_mode!r}")
    stateful = resume_from is not None and resume_mode == "stateful"
    if resume_from is not None:
        _require_run_dir(Path(resume_from))
        resume_from = Path(resume_from).resolve()  # ".", a symlink: the run itself (its lease, its id)
    identity = (trainer.run_id, trainer.runs_root, trainer.run_dir)  # given back when the call is refused
    if stateful:
        source = resume_from
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
    lease = Lease(trainer.runs_root, run_id)
    began = created = False
    try:
        lease.acquire()
        created = not run_dir.exists()  # under the lease: what appears in it now is this call's
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
        with LmdbLog(run_dir / "events.lmdb") as event_log:
            trainer.store = BlobStore(run_dir / "blobs", log=event_log)  # manifests go to the log with LAST
            if stateful:
                point = find_resume_point(run_dir, event_log, expect_run_id=run_id)
                _check_same_recipe(trainer, point.started, point.manifest)
                check_epochs(epochs, point.manifest.epoch + 1)
                seed_everything(trainer.seed)  # then the checkpoint's RNG streams are restored over it
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
                seed_everything(trainer.seed)
                src = None
                if resume_from is not None:
                    src = _load_weights_from(trainer, resume_from)
                trainer.recorder = Recorder(event_log)
                opening = _run_started(trainer, src)
                start_epoch = 0
            began = True
            yield opening, start_epoch
    except BaseException:
        if not began:  # refused before the run began: the trainer as it was, and no empty run to block a retry
            trainer.run_id, trainer.runs_root, trainer.run_dir = identity
            if created:
                shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        if getattr(trainer, "store", None) is not None and trainer.store.log is not None:
            trainer.store = BlobStore(run_dir / "blobs")  # the session's log is closed: later reads open their own
        lease.release()


def _require_run_dir(source: Path) -> None:
    """Refuse a ``resume_from`` that is not a run directory (a runs root, a file, a typo).

    Raises:
        ResumeError: ``source`` has no ``events.lmdb`` directory (named, with the runs it
            holds when it is a runs root).
    """
    if (source / "events.lmdb").is_dir():
        return
    what = "does not exist" if not source.exists() else "is not a directory" if not source.is_dir() else ""
    runs = sorted(p for p in source.iterdir() if (p / "events.lmdb").is_dir()) if source.is_dir() else []
    hint = f"; it looks like a runs root: pass one of its runs, e.g. {str(runs[0])!r}" if runs else ""
    raise ResumeError(
        f"resume_from={str(source)!r} is not a run directory: it has no event log (no events.lmdb there"
        f"{', it ' + what if what else ''}){hint}; nothing was restored or written"
    )


def _check_same_recipe(trainer: Trainer, started: RunStarted | None, manifest: Manifest) -> None:
    """A stateful resume continues the same recipe: optimizers, schedulers, monitor, window and
    averaging update hooks.

    The averaging hooks (:class:`~nnx_es.update_hooks.EMA`) are not declared in ``run_started``:
    they are read from the LAST ``manifest``'s ``update_hook/<name>`` components, in order (the
    first is the one validation evaluates). Another set would drop or restart the averaged
    weights and let BEST compare averaged against raw scores. Their ``decay`` is recorded
    nowhere and is not checked.

    Raises:
        ResumeError: naming what differs from the run's ``run_started`` declaration or its LAST.
    """
    theirs = [n.removeprefix("update_hook/") for n in manifest.components if n.startswith("update_hook/")]
    ours = [h.name for h in trainer.update_hooks if isinstance(h, EMA)]
    if theirs != ours:
        raise ResumeError(
            f"cannot resume run {manifest.run_id!r} statefully with other averaging update hooks: its LAST "
            f"holds EMA state {theirs}, this trainer has EMA hooks named {ours} (the averaged weights would be "
            "dropped or restarted); pass the run's EMA hooks (EMA(decay, name=...)) in the same order, or use "
            "resume_mode='weights_only' to start a new run; nothing was restored or written"
        )
    check_same_loaders(manifest.run_id, started.loaders if started else None, trainer.loaders)
    if started is None:
        return
    mine = _run_started(trainer, None)
    for field, label in (("optimizers", "optimizers"), ("schedulers", "schedulers"), ("monitor", "monitor"),
                         ("accumulation", "accumulation window"), ("update", "precision or gradient clipping")):
        theirs, ours = getattr(started, field), getattr(mine, field)
        if theirs != ours and not (field == "update" and theirs is None):  # None: an older run declared none
            raise ResumeError(
                f"cannot resume run {started.run_id!r} statefully with a different {label}: the run declared "
                f"{theirs!r}, this trainer has {ours!r} (use resume_mode='weights_only' to start a new run); "
                "nothing was restored or written"
            )


def _load_weights_from(trainer: Trainer, source: Path) -> SourceRef:
    """Load the model weights of ``source``'s verified LAST into ``trainer``; return the source reference."""
    if source.resolve() == (trainer.runs_root / (trainer.run_id or "")).resolve():
        raise ConfigError(f"a weights_only continuation must write its own run, not its source {source}")
    if not (source / "events.lmdb" / "data.mdb").exists():
        raise ResumeError(f"cannot start from {source}: it has no event log; nothing was restored or written")
    with LmdbLog(source / "events.lmdb", readonly=True) as src_log:
        point = find_resume_point(source, src_log)
        apply_state(trainer, load_state(BlobStore(source / "blobs", log=src_log), point.manifest), weights_only=True)
    return SourceRef(run_id=point.run_id, last_seq=point.last_seq, manifest=point.manifest_hash)


def _run_started(trainer: Trainer, source: SourceRef | None) -> RunStarted:
    return RunStarted(
        run_id=trainer.run_id or "", seed=trainer.seed, recipe=trainer.recipe, library_versions=_library_versions(),
        callbacks=[cb.name for cb in trainer.callbacks], optimizers=list(trainer.optimizers),
        schedulers=[s.decl() for s in trainer.schedulers],
        monitor=trainer.monitor.spec if trainer.monitor else None, accumulation=trainer.engine.accumulation,
        update=UpdateSpec(precision=trainer.engine.precision, clip_grad_norm=trainer.engine.clip_grad_norm),
        source=source, wall_time_s=time.time(), loaders=loader_geometries(trainer.loaders),
    )

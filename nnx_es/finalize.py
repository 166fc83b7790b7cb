"""Finalization of a run: failure record, callback cleanup in reverse order, LAST refresh.

Semantics (spec 000, "Lifecycle order" and failure semantics):

* on failure, ``run_failed`` is recorded first;
* ``on_train_end`` runs in reverse list order for every callback whose
  ``on_train_begin`` completed — on success and on failure; every cleanup hook
  is attempted and recorded (``callback_finalized``, with its error if any);
* a cleanup error never masks the training error; after a successful run it
  fails the run and is raised once everything else ran;
* LAST is refreshed after finalization (so callback mutations persist), except
  after a failure or a stop at an update boundary, where LAST stays at the
  last committed epoch;
* ``run_finalized`` is committed (synced) last; views are materialized after it.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from events.schema import CallbackFinalized, RunFailed, RunFinalized

if TYPE_CHECKING:
    from nnx_es.callbacks import Callback
    from nnx_es.trainer import Trainer

__all__ = ["finalize"]

log = structlog.get_logger("nnx_es")


def _attempt(fn: Callable[[], Any]) -> None:
    """Run one finalization step; its error is logged, never raised over the training error."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        log.error("finalization step failed", error=f"{type(exc).__name__}: {exc}")


def _run_failed(trainer: Trainer, exc: BaseException, with_traceback: bool) -> None:
    rec, ctx = trainer.recorder, trainer.ctx
    if rec.accepts("run_failed"):
        rec.emit(RunFailed(
            error_type=type(exc).__name__, message=str(exc), epoch=ctx.epoch, step=ctx.step_count,
            traceback="".join(traceback.format_exception(exc))[-4000:] if with_traceback else "",
        ))


def finalize(
    trainer: Trainer,
    begun: list[tuple[int, Callback]],
    failure: BaseException | None,
    stopped_at_update: bool,
    t0: float,
) -> None:
    """Finalize ``trainer``'s run (see the module docstring). Raises a cleanup error after a successful run."""
    rec, ctx = trainer.recorder, trainer.ctx
    # a commit still in flight lands first: its blobs may be durable already
    _attempt(trainer.committer.complete)
    _attempt(trainer.committer.close)
    if failure is not None:
        log.error("training failed", run_id=trainer.run_id, error=repr(failure))
        _attempt(lambda: _run_failed(trainer, failure, True))
    cleanup_error: BaseException | None = None
    for index, cb in reversed(begun):
        error = None
        try:
            cb.on_train_end(ctx)
        except BaseException as exc:  # noqa: BLE001 - every cleanup hook is attempted
            error = f"{type(exc).__name__}: {exc}"
            log.error("callback cleanup failed", callback=cb.name, error=error)
            cleanup_error = cleanup_error or exc
        _attempt(lambda cb=cb, i=index, e=error: rec.emit(CallbackFinalized(name=cb.name, index=i, error=e)))
    if failure is not None:
        status = "failed"
    elif cleanup_error is not None:
        _attempt(lambda: _run_failed(trainer, cleanup_error, False))
        status = "failed"
    else:
        status = "stopped" if (stopped_at_update or trainer._stop) else "completed"
    if status != "failed" and not stopped_at_update:
        _attempt(lambda: trainer._commit_last(epoch=rec.counters.epoch - 1, final=True))
    _attempt(lambda: rec.commit(RunFinalized(
        status=status, epochs=rec.counters.epoch, steps=rec.counters.step, wall_time_s=time.time() - t0,
    )))
    _attempt(lambda: _write_views(trainer))
    if failure is None and cleanup_error is not None:
        raise cleanup_error


def _write_views(trainer: Trainer) -> None:
    from nnx_es.views import write_views
    from projections.view import project

    assert trainer.run_dir is not None
    write_views(trainer.run_dir, project(trainer.recorder.log.read()))

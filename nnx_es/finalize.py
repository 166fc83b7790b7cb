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
* ``run_finalized`` is committed (synced) last; views are materialized after it;
* a failure of these closing writes (the final LAST, ``run_finalized``, a view
  file) is raised to the caller after a successful run; a failed final LAST
  records the run as failed, and LAST stays at the last committed epoch.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from events.schema import CallbackFinalized, RunFailed, RunFinalized
from nnx_es.callbacks import Callback, LambdaCallback
from nnx_es.stages import TrainingStage

if TYPE_CHECKING:
    from nnx_es.trainer import Trainer

__all__ = ["finalization_may_change_state", "finalize"]

log = structlog.get_logger("nnx_es")


def _log_error(event: str, **fields: Any) -> None:
    """Log an error; a broken log stream never masks the error being finalized."""
    try:
        log.error(event, **fields)
    except Exception:  # noqa: BLE001 - logs are diagnostics only
        pass


def _attempt(fn: Callable[[], Any]) -> None:
    """Run one finalization step; its error is logged, never raised over the training error."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        _log_error("finalization step failed", error=f"{type(exc).__name__}: {exc}")


def _run_failed(trainer: Trainer, exc: BaseException, with_traceback: bool) -> None:
    rec, ctx = trainer.recorder, trainer.ctx
    if rec.accepts("run_failed"):
        rec.emit(RunFailed(
            error_type=type(exc).__name__, message=str(exc) or ("interrupted" if isinstance(exc, KeyboardInterrupt)
                                                                else repr(exc)),
            epoch=ctx.epoch, step=ctx.step_count,
            traceback="".join(traceback.format_exception(exc))[-4000:] if with_traceback else "",
        ))


def finalization_may_change_state(trainer: Trainer) -> bool:
    """Whether anything that runs at finalization could change the state a checkpoint holds: an
    ``AFTER_TRAINING`` stage hook, or a callback's ``on_train_end`` other than the base no-op
    (overridden in its class, given to a LambdaCallback, or assigned on the instance)."""
    if trainer.stages.has(TrainingStage.AFTER_TRAINING):
        return True
    for cb in trainer.callbacks:
        if isinstance(cb, LambdaCallback):
            if cb.has("on_train_end"):
                return True
        elif getattr(cb.on_train_end, "__func__", None) is not Callback.on_train_end:
            return True
    return False


def finalize(
    trainer: Trainer,
    begun: list[tuple[int, Callback]],
    failure: BaseException | None,
    stopped_at_update: bool,
    t0: float,
) -> None:
    """Finalize ``trainer``'s run (see the module docstring).

    Raises:
        Exception: after a successful run, the first cleanup error, else the first
            failure of a closing write (never over a training error).
    """
    rec, ctx = trainer.recorder, trainer.ctx
    # a commit still in flight lands first: its blobs may be durable already
    _attempt(trainer.committer.complete)
    _attempt(trainer.committer.close)
    if failure is not None:
        _log_error("training failed", run_id=trainer.run_id, error=repr(failure))
        _attempt(lambda: _run_failed(trainer, failure, True))
    cleanup_error: BaseException | None = None
    for index, cb in reversed(begun):
        error = None
        try:
            cb.on_train_end(ctx)
        except BaseException as exc:  # noqa: BLE001 - every cleanup hook is attempted
            error = f"{type(exc).__name__}: {exc}"
            _log_error("callback cleanup failed", callback=cb.name, error=error)
            cleanup_error = cleanup_error or exc
        _attempt(lambda cb=cb, i=index, e=error: rec.emit(CallbackFinalized(name=cb.name, index=i, error=e)))
    if failure is not None:
        status = "failed"
    elif cleanup_error is not None:
        _attempt(lambda: _run_failed(trainer, cleanup_error, False))
        status = "failed"
    else:
        status = "stopped" if (stopped_at_update or trainer._stop) else "completed"
    # the finalization records are written before the final LAST: a failed LAST commit
    # drops its own unwritten events only, never the record of the cleanups
    _attempt(rec.flush)
    closing_error: BaseException | None = None  # a failed final LAST, run_finalized or view write
    if status != "failed" and not stopped_at_update:
        try:
            trainer._commit_last(epoch=rec.counters.epoch - 1, final=True)
        except BaseException as exc:  # noqa: BLE001 - the run fails; raised once finalized
            _log_error("final LAST commit failed", run_id=trainer.run_id, error=f"{type(exc).__name__}: {exc}")
            closing_error = exc
            _attempt(lambda e=exc: _run_failed(trainer, e, True))
            status = "failed"
    for step in (
        lambda: rec.commit(RunFinalized(
            status=status, epochs=rec.counters.epoch, steps=rec.counters.step, wall_time_s=time.time() - t0,
        )),
        lambda: _write_views(trainer),
    ):
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - never masks the training error
            _log_error("finalization step failed", run_id=trainer.run_id, error=f"{type(exc).__name__}: {exc}")
            closing_error = closing_error or exc
    if failure is None and (cleanup_error or closing_error) is not None:
        raise cleanup_error or closing_error  # type: ignore[misc]


def _write_views(trainer: Trainer) -> None:
    from nnx_es.views import write_views
    from projections.view import project

    assert trainer.run_dir is not None
    log = trainer.recorder.log
    p = project(log.read())
    write_views(trainer.run_dir, p)
    trainer.final_projection = (p, log.next_seq)  # fit() returns its RunResult without reading the log again

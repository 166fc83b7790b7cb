"""Finalization of a run: failure record, callback cleanup in reverse order, LAST refresh.

Semantics (spec 000, "Lifecycle order" and failure semantics):

* on failure, ``run_failed`` is recorded first; a ``KeyboardInterrupt`` (Ctrl-C) ends the run
  ``interrupted`` (resumable like any other), any other failure ``failed``;
* a run that trained microbatches but committed no optimizer update fails
  (:class:`~nnx_es.errors.NoUpdateError`): it never ends ``completed``;
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
from nnx_es.callbacks import Callback, CallbackList
from nnx_es.distributed.peers import cause_first, peer_failures, post_failure
from nnx_es.errors import NoUpdateError
from nnx_es.stages import StageDispatcher, TrainingStage

if TYPE_CHECKING:
    from nnx_es.runtime.commit import Committer
    from nnx_es.runtime.context import TrainContext
    from nnx_es.runtime.run_state import RunState
    from projections.view import Projections

__all__ = ["Finalization", "finalization_may_change_state"]

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


def finalization_may_change_state(callbacks: CallbackList, stages: StageDispatcher) -> bool:
    """Whether anything that runs at finalization could change the state a checkpoint holds: an
    ``AFTER_TRAINING`` stage hook, or a callback implementing ``on_train_end`` (overridden in its
    class, given to a LambdaCallback, or assigned on the instance: :func:`~nnx_es.callbacks.implements`)."""
    return stages.has(TrainingStage.AFTER_TRAINING) or callbacks.has("on_train_end")


class Finalization:
    """Finalizes one run (see the module docstring).

    Args:
        state: the run (recorder, run directory, stop request).
        callbacks: the run's callbacks; those in ``callbacks.begun`` are finalized.
        committer: commits the final LAST.
        stages: the stage hooks (an ``AFTER_TRAINING`` one may change the state).
        ctx: the context the cleanup hooks receive.
    """

    def __init__(self, state: RunState, callbacks: CallbackList, committer: Committer, stages: StageDispatcher,
                 ctx: TrainContext) -> None:
        self.state = state
        self.callbacks = callbacks
        self.committer = committer
        self.stages = stages
        self.ctx = ctx
        #: the projections the views were written from, and the log's length then
        self.projection: tuple[Projections, int] | None = None
        #: this session of the run, alike on every rank (its opening's seq): where failures are posted
        self.session = f"{state.run_id}@{state.recorder.log.next_seq}"

    def _run_failed(self, exc: BaseException, with_traceback: bool, epoch: int) -> None:
        rec = self.state.recorder
        if rec.accepts("run_failed"):
            message = str(exc) or ("interrupted" if isinstance(exc, KeyboardInterrupt) else repr(exc))
            others = peer_failures(self.state.world, self.session)
            if others:  # under DDP this rank's error is often the symptom (a closed connection) of theirs
                exc.add_note(f"nnx_es: failed on another rank: {'; '.join(others)}")
            # the record leads with the cause: the first failing rank's error, this rank's symptom after it
            error_type, message = cause_first(type(exc).__name__, message, self.state.world.rank, others)
            rec.emit(RunFailed(
                error_type=error_type, message=message,
                epoch=epoch, step=rec.live.step,
                traceback="".join(traceback.format_exception(exc))[-4000:] if with_traceback else "",
            ))

    def run(self, failure: BaseException | None, stopped_at_update: bool, t0: float, *, epoch: int) -> None:
        """Finalize the run; ``t0``: its start (``time.time()``, seconds); ``epoch``: the epoch it was in
        (a failure is recorded in it).

        Raises:
            Exception: after a successful run, the first cleanup error, else the first
                failure of a closing write (never over a training error).
        """
        state, committer = self.state, self.committer
        rec = state.recorder
        if failure is not None:  # first: the writer's record names it (nnx_es.distributed.peers)
            post_failure(state.world, self.session, failure)
        # a commit still in flight lands first: its blobs may be durable already
        _attempt(committer.complete)
        _attempt(committer.close)
        if failure is not None:
            _log_error("training failed", run_id=state.run_id, error=repr(failure))
            _attempt(lambda: self._run_failed(failure, True, epoch))
        errors: list[BaseException] = []

        def finalized(index: int, cb: Callback, error: BaseException | None) -> None:
            text = None
            if error is not None:
                text = f"{type(error).__name__}: {error}"
                _log_error("callback cleanup failed", callback=cb.name, error=text)
                errors.append(error)
            _attempt(lambda: rec.emit(CallbackFinalized(name=cb.name, index=index, error=text)))

        self.callbacks.train_end(self.ctx, finalized)
        cleanup_error = errors[0] if errors else None
        counters = rec.counters
        if failure is None and cleanup_error is None and counters.step == 0 and counters.batch > 0:
            cleanup_error = NoUpdateError(
                f"the run trained {counters.batch} microbatches in {counters.epoch} epochs but committed no optimizer "
                "update: every window was skipped (non-finite losses or gradients, no row with a weight, or a "
                "custom trainer_step_fn that never calls ctx.report_update); see the update_skipped events "
                "(tools/inspect RUN --kind update_skipped)")
        if failure is not None:
            status = "interrupted" if isinstance(failure, KeyboardInterrupt) else "failed"
        elif cleanup_error is not None:
            _attempt(lambda: self._run_failed(cleanup_error, False, epoch))
            status = "failed"
        else:
            status = "stopped" if (stopped_at_update or state.stop_requested) else "completed"
        # the finalization records are written before the final LAST: a failed LAST commit
        # drops its own unwritten events only, never the record of the cleanups
        _attempt(rec.flush)
        closing_error: BaseException | None = None  # a failed final LAST, run_finalized or view write
        if status not in ("failed", "interrupted") and not stopped_at_update:
            try:
                committer.commit_now(epoch=rec.counters.epoch - 1, final=True,
                                     state_may_have_changed=finalization_may_change_state(self.callbacks, self.stages))
            except BaseException as exc:  # noqa: BLE001 - the run fails; raised once finalized
                _log_error("final LAST commit failed", run_id=state.run_id, error=f"{type(exc).__name__}: {exc}")
                closing_error = exc
                _attempt(lambda e=exc: self._run_failed(e, True, epoch))
                status = "failed"
        for step in (
            lambda: rec.commit(RunFinalized(
                status=status, epochs=rec.counters.epoch, steps=rec.counters.step, wall_time_s=time.time() - t0,
            )),
            self._write_views,
        ):
            try:
                step()
            except BaseException as exc:  # noqa: BLE001 - never masks the training error
                _log_error("finalization step failed", run_id=state.run_id, error=f"{type(exc).__name__}: {exc}")
                closing_error = closing_error or exc
        if failure is None and (cleanup_error or closing_error) is not None:
            raise cleanup_error or closing_error  # type: ignore[misc]

    def _write_views(self) -> None:
        from nnx_es.audit.snapshots import project_log
        from nnx_es.views import write_views

        if not self.state.world.is_writer:  # only the writer materializes views (and holds the log to project)
            return
        rec = self.state.recorder
        log = rec.log
        # the recorder's snapshot fold has folded every event already (no second fold of the log);
        # else from the newest projection snapshot on: O(events since it)
        p = rec.final_projections() or project_log(log).projections
        write_views(self.state.run_dir, p)
        self.projection = (p, log.next_seq)  # fit() returns its RunResult without reading the log again

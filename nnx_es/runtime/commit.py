"""The durable commit of an epoch: checkpoint blobs, then LAST and its group in one synced write.

Order (spec 000, durable commit order; DESIGN.md "Performance budget")::

    history_appended                        (the epoch's record; the commit covers up to here)
    capture the state in memory             (training thread: copies of the state dicts, RNG, ...)
    serialize; write and fsync the blob files of large components   (inline, or on a background
                                            thread when lag > 0)
    stage the manifest and small callback states in the log (``BlobStore.stage``)
    checkpoint_stored -> last_committed -> best_committed? -> phase_committed? -> callback_checkpointed*
    one synced log write                    (LAST is the only thing readers trust; the manifest
                                            it names is in the same transaction)

A small model's commit is one fsync (the log's); each commit with blob files adds
their fsyncs and one directory fsync.

A new run's opening checkpoint (epoch -1) follows the same rule: with a lag its
LAST lands during the first epoch and ``covers`` the opening events only.

With ``lag == 0`` the commit completes at the epoch's end. With ``lag = N > 0``
the blobs are persisted on a background thread while the next epoch trains,
and the training thread appends LAST after exactly N committed updates of the
next epoch (waiting for the thread only if it is not done by then), so the
log's layout stays deterministic while the fsyncs leave the training thread.
LAST then ``covers`` its epoch's history only; the next epoch's events before
it stay uncommitted (:func:`projections.view.committed`). Every
``nnx_es.runtime.recording.SNAPSHOT_EVERY`` events or more, the epoch's commit completes inline
all the same, so that the committed view holds nothing back where the projection snapshot
is stored (single process; :meth:`Committer._snapshot_due`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import structlog

from events.schema import (
    BestCommitted,
    CallbackCheckpointed,
    CheckpointPruned,
    CheckpointStored,
    Counters,
    LastCommitted,
    MonitorDecided,
    PhaseCommitted,
)
from nnx_es.checkpoint import INLINE_MAX, Manifest, encode_checkpoint, read_manifest
from nnx_es.distributed.verdict import agree_outcome
from nnx_es.errors import ConfigError, CorruptCheckpointError
from nnx_es.retention import prunable
from nnx_es.runtime.components import RunComponents, capture, encode_parts
from projections.checkpoints import CheckpointsState, fold_checkpoints

if TYPE_CHECKING:
    from nnx_es.callbacks import CallbackList
    from nnx_es.runtime.context import TrainContext
    from nnx_es.runtime.run_state import RunState

__all__ = ["Committer", "checkpoint_lag"]

log = structlog.get_logger("nnx_es")


def checkpoint_lag(lag: int | str) -> int:
    """``Trainer(checkpoint_lag=...)`` as committed updates: ``"epoch"`` is never reached inside an
    epoch (the commit completes before the next history).

    Raises:
        ConfigError: ``lag`` is neither an int >= 0 nor ``"epoch"``.
    """
    if lag == "epoch":
        return 2**62
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
        raise ConfigError(f"checkpoint_lag must be an int >= 0 committed updates or 'epoch', got {lag!r}")
    return lag


class _Pending:
    __slots__ = ("epoch", "covers", "counters", "decision", "phase", "final", "future", "updates")

    def __init__(self, epoch: int, covers: int, counters: Counters, decision: MonitorDecided | None,
                 phase: str | None, final: bool, future: Future[Any]) -> None:
        self.epoch = epoch
        self.covers = covers
        self.counters = counters
        self.decision = decision
        self.phase = phase
        self.final = final
        self.future = future
        self.updates = 0


class Committer:
    """Submits and completes checkpoint commits for one run (at most one in flight).

    Args:
        state: the run (its recorder, store, id and world).
        components: what a checkpoint captures (:class:`~nnx_es.runtime.components.RunComponents`).
        callbacks: the run's callbacks (their deferred checkpoints join each epoch's commit).
        ctx: the context handed to :meth:`~nnx_es.callbacks.Callback.checkpoint`.
        lag: committed updates of the next epoch after which LAST is appended
            (0: at the epoch's own end; :func:`checkpoint_lag` reads ``"epoch"``).
        phase_every / keep_phases: a phase checkpoint every N epochs; keep the newest K.
        keep_last / keep_best: checkpoint retention (:mod:`nnx_es.retention`): each commit prunes,
            in its group, the checkpoints no kept pointer needs; their bytes are deleted after the
            group's synced write.
        pointers: the run's checkpoints projection so far (a resume's; empty for a new run), folded
            on with every commit event this committer writes.
        on_durable: called (no arguments) after each commit is durable, on the training thread (live
            sinks collect then); None: nothing.
    """

    def __init__(self, state: RunState, components: RunComponents, callbacks: CallbackList, ctx: TrainContext, *,
                 lag: int = 0, phase_every: int | None = None, keep_phases: int | None = None,
                 keep_last: int | None = 1, keep_best: bool = True,
                 pointers: CheckpointsState | None = None, on_durable: Callable[[], None] | None = None) -> None:
        self.state = state
        self.components = components
        self.callbacks = callbacks
        self.ctx = ctx
        self.lag = lag
        self.phase_every = phase_every
        self.keep_phases = keep_phases
        self.pending: _Pending | None = None
        #: (manifest hash, counters) of the last completed commit
        self.last_done: tuple[str, Counters] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.keep_last, self.keep_best = keep_last, keep_best
        self.pointers = pointers or CheckpointsState()
        self.phases: list[str] = list(self.pointers.phases)
        self._blobs_of: dict[str, set[str]] = {}  # manifest -> the blobs of its components stored apart
        self.on_durable = on_durable

    def submit(self, *, epoch: int, covers: int = -1, decision: MonitorDecided | None = None,
               final: bool = False, group: bool = True, opening: bool = False) -> None:
        """Capture the run's state now and start persisting it (see the module docstring).

        ``opening``: a new run's first checkpoint, deferred like an epoch's when the lag is
        > 0 (other group-less commits -- a resumed session's opening, the final refresh --
        complete before this returns).
        """
        self.complete()  # at most one commit in flight
        state = self.state
        counters = state.recorder.counters
        world = state.world.size
        parts = capture(self.components, epoch, world)
        callbacks = self.callbacks.checkpoints(self.ctx) if group else []
        phase = None
        if group and self.phase_every is not None and (epoch + 1) % self.phase_every == 0:
            phase = f"epoch-{epoch:04d}"
        store, run_id = state.store, state.run_id

        def persist() -> tuple[str, Manifest, bytes, list[tuple[str, str, bytes | None]]]:
            digest, manifest, data = encode_checkpoint(
                store, run_id=run_id, epoch=epoch, step=counters.step, counters=counters,
                parts=encode_parts(parts), world_size=world,
            )
            # callback states: small ones go to the log with LAST (complete()), large ones are files now
            states = [(name, store.put(state), None) if len(state) > INLINE_MAX else (name, "", state)
                      for name, state in callbacks]
            return digest, manifest, data, states

        future: Future[Any] = Future()
        inline = self.lag == 0 or final or (not group and not opening) or (group and self._snapshot_due())
        if inline:
            try:
                future.set_result(persist())
            except BaseException as exc:  # noqa: BLE001 - re-raised by complete()
                future.set_exception(exc)
        else:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nnx_es-commit")
            future = self._executor.submit(persist)
        self.pending = _Pending(epoch, covers, counters, decision, phase, final, future)
        if inline:
            self.complete()

    def _snapshot_due(self) -> bool:
        """Whether this epoch's commit completes inline for a projection snapshot: one is due, and a
        deferred LAST would leave the next epoch's events pending where it is to be stored
        (:meth:`nnx_es.runtime.recording.Recorder.snapshot_due`). Single process only: under data
        parallelism every rank must defer alike, and only the writer keeps snapshots."""
        return not self.state.world.distributed and self.state.recorder.snapshot_due()

    def on_update(self) -> None:
        """Count a committed update; complete a pending commit after ``lag`` of them."""
        p = self.pending
        if p is not None:
            p.updates += 1
            if p.updates >= self.lag:
                self.complete()

    def complete(self) -> str | None:
        """Wait for the pending commit, append LAST and its group, sync once. Returns the manifest hash.

        Under data parallelism the outcome is agreed (agreement point 3): the writer's commit is
        durable, the others' in memory; one all-gather tells every rank whether each succeeded,
        and a failure on any rank (a write fault on the writer) is raised on every rank alike.

        Raises:
            CheckpointWriteError: persisting the blobs failed; LAST is not written,
                so the epoch's history stays uncommitted (rolled back).
        """
        p = self.pending
        if p is None:
            return None
        self.pending = None
        world = self.state.world
        if not world.distributed:
            return self._complete(p)
        digest: str | None = None
        error: BaseException | None = None
        try:
            digest = self._complete(p)
        except BaseException as exc:  # noqa: BLE001 - agreed, then raised on every rank
            error = exc
        agree_outcome(world, error)
        return digest

    def _complete(self, p: _Pending) -> str:
        digest, manifest, data, states = p.future.result()
        store = self.state.store
        store.stage(data, digest)  # written in the synced transaction below, with LAST (digest: data's hash)
        callback_blobs = [(name, blob if state is None else store.stage(state)) for name, blob, state in states]
        rec = self.state.recorder
        self._blobs_of[digest] = {c.blob for c in manifest.components.values() if c.data is None}
        rec.emit(CheckpointStored(
            manifest=digest, epoch=p.epoch, step=p.counters.step,
            components={k: c.blob for k, c in manifest.components.items()},
            bytes=sum(c.bytes for c in manifest.components.values()),
        ))
        self._emit(LastCommitted(manifest=digest, epoch=p.epoch, step=p.counters.step, counters=p.counters,
                                 final=p.final, covers=p.covers))
        doomed: list[str] = []
        try:
            d = p.decision
            if d is not None and d.improved:
                self._emit(BestCommitted(manifest=digest, epoch=p.epoch, monitor=d.monitor, value=d.value))
            if p.phase is not None:
                self.phases.append(p.phase)
                keep = self.keep_phases
                removed = self.phases[:-keep] if keep is not None and len(self.phases) > keep else []
                self.phases = self.phases[len(removed):]
                self._emit(PhaseCommitted(name=p.phase, manifest=digest, epoch=p.epoch, removed=removed))
            for name, blob in callback_blobs:
                rec.emit(CallbackCheckpointed(name=name, epoch=p.epoch, blob=blob))
            doomed = self._prune()
        finally:
            rec.sync()  # LAST and its group: one synced write
        self.last_done = (digest, p.counters)
        if self.on_durable is not None:
            self.on_durable()
        if doomed:  # only once the prunes are durable: a crash before leaves the bytes, never a pointer without them
            try:
                self.state.store.delete(doomed)
            except OSError as exc:
                log.warning("pruned checkpoint blobs could not be deleted (they stay, marked pruned)",
                            run_id=self.state.run_id, error=str(exc))
        return digest

    def _emit(self, event: LastCommitted | BestCommitted | PhaseCommitted | CheckpointPruned) -> None:
        self.state.recorder.emit(event)
        self.pointers = fold_checkpoints(self.pointers, event)

    def _components(self, manifest: str) -> set[str]:
        """The blobs a stored checkpoint keeps apart from its manifest (an unreadable one: none)."""
        if manifest not in self._blobs_of:
            try:
                m = read_manifest(self.state.store, manifest)
                self._blobs_of[manifest] = {c.blob for c in m.components.values() if c.data is None}
            except CorruptCheckpointError:
                self._blobs_of[manifest] = set()
        return self._blobs_of[manifest]

    def _prune(self) -> list[str]:
        """Emit ``checkpoint_pruned`` for every checkpoint retention lets go; return the blobs to delete
        (each pruned manifest and the component blobs no kept checkpoint shares)."""
        doomed: list[str] = []
        plan = prunable(self.pointers, keep_last=self.keep_last, keep_best=self.keep_best)
        if not plan:
            return doomed
        pruned = {m for m, _, _ in plan}
        shared = set().union(*(self._components(m) for m in self.pointers.stored if m not in pruned))
        for manifest, epoch, reason in plan:
            blobs = [manifest, *sorted(self._components(manifest) - shared)]
            self._emit(CheckpointPruned(manifest=manifest, epoch=epoch, reason=reason, blobs=blobs))
            self._blobs_of.pop(manifest, None)
            doomed += blobs
        return doomed

    def commit_now(self, *, epoch: int, final: bool = False, state_may_have_changed: bool = True) -> None:
        """Commit LAST synchronously: the initial checkpoint and the refresh after finalization.

        The final refresh names the last commit's manifest again, without capturing, when
        the caller says nothing since that commit can have changed the state (no callback
        ``on_train_end`` nor ``AFTER_TRAINING`` stage hook ran) and the counters are the same.

        Raises:
            CheckpointWriteError: persisting failed (LAST is not written).
        """
        self.complete()
        if final and not state_may_have_changed and self.recommit_final(epoch=epoch):
            return
        self.submit(epoch=epoch, final=final, group=False)

    def recommit_final(self, *, epoch: int) -> bool:
        """Append the final LAST naming the last commit's manifest, if the counters have not
        moved since it (the caller vouches that nothing else changed the state); sync it.

        Returns:
            False when there is no such commit or the counters moved (nothing written).
        """
        rec = self.state.recorder
        if self.pending is not None or self.last_done is None or self.last_done[1] != rec.counters:
            return False
        digest, counters = self.last_done
        self._emit(LastCommitted(manifest=digest, epoch=epoch, step=counters.step, counters=counters, final=True))
        rec.sync()
        return True

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

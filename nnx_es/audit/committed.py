"""Checks over the committed view (:func:`projections.committed`), with the projections folded so far.

* invariant 4: every manifest a committed LAST / BEST / phase names verifies
  (:func:`nnx_es.checkpoint.verify_checkpoint`), and every callback checkpoint blob; an exported
  artifact still at its path has the SHA-256 its path's latest ``model_exported`` recorded (a later
  export to the same path supersedes an earlier one: that one is noted, not checked);
* invariant 6: scheduler clocks (epoch: once per summarized epoch, at the epoch
  end, a plateau one once per epoch with a decision; optimizer_update: once
  after each ``update_committed`` of its optimizer); ``steps`` grows by 1;
* invariant 7: at most one decision per epoch, exactly one per validated epoch
  when the monitor is a ``val_`` metric; the decision is coherent with the
  metric and the previous decision; BEST iff improved; plateau agrees;
* invariant 10: counters and the ``schedulers`` component in each committed LAST's manifest equal the projections.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from events.schema import (
    BestCommitted,
    CallbackCheckpointed,
    CheckpointPruned,
    EpochBegan,
    EpochSummarized,
    EvaluationRecorded,
    Event,
    HistoryAppended,
    JournalPublished,
    LastCommitted,
    ModelExported,
    MonitorDecided,
    MonitorSpec,
    PhaseCommitted,
    PlateauState,
    RunFinalized,
    RunResumed,
    RowsRecorded,
    RunStarted,
    SchedulerDecl,
    SchedulerStepped,
    ValidationDone,
)
from events.errors import UnsafePathError
from nnx_es.artifacts import file_sha256
from nnx_es.audit.report import Sink
from nnx_es.audit.states import same_float, same_scheduler_state
from nnx_es.checkpoint import Manifest, load_component, verify_checkpoint
from nnx_es.errors import CorruptCheckpointError
from nnx_es.monitor import improves
from nnx_es.rows.columns import check_columns
from nnx_es.rows.journal import verify_manifest
from nnx_es.storage import BlobStore
from projections import Projections

__all__ = ["CommittedCheck", "Folded"]


class Folded(Protocol):
    """What the committed-view checks are fed beside each event: the projections folded through it."""

    @property
    def p(self) -> Projections: ...


_WINDOW_KINDS = frozenset({"update_committed", "scheduler_stepped"})


class CommittedCheck:
    """Fed the committed view in order: ``feed(seq, event, folded)`` with ``folded.p`` folded through ``event``."""

    def __init__(self, sink: Sink, store: BlobStore, run_id: str) -> None:
        self.sink = sink
        self.store = store
        self.run_id = run_id
        self.manifests: dict[str, Manifest | None] = {}  # digest -> verified manifest (None: corrupt)
        #: digest -> (seq, kind, why) of manifests that did not verify: a violation unless retention pruned them
        self.unverified: dict[str, tuple[int, str, str]] = {}
        self.pruned: set[str] = set()
        self.blobs: dict[str, bool] = {}
        self.decls: dict[str, SchedulerDecl] = {}
        self.monitor: MonitorSpec | None = None
        self.steps: dict[str, int] = {}
        # the current epoch
        self.epoch: int | None = None
        self.epoch_end = False  # epoch_summarized seen, history not yet
        self.epoch_steps: dict[str, int] = {}
        self.validated: dict[int, dict[str, float]] = {}  # epoch -> metrics of its epoch-end validation
        self.validation: dict[str, float] | None = None  # the last validation, until epoch_summarized
        self.summary: dict[str, float] = {}
        # optimizer_update clock: scheduler -> (seq of the first unpaid receipt, count owed)
        self.owed: dict[str, tuple[int, int]] = {}
        self.prev_kind = ""
        # monitor decisions
        self.decisions: dict[int, tuple[int, MonitorDecided]] = {}
        self.prev_decision: MonitorDecided | None = None
        self.best_epochs: set[int] = set()
        self.pending_best: tuple[int, int, int] | None = None  # (LAST seq, epoch, decision seq)
        self.journal_head = ""  # the manifest of the newest committed journal_published
        self.update_clocked = False  # a scheduler on the optimizer_update clock is declared
        self.exports: dict[str, tuple[int, ModelExported]] = {}  # file (links resolved) -> its latest model_exported (seq, event)

    def hot_inert(self) -> bool:
        """Whether :meth:`feed` of a ``microbatch_done`` or an ``update_committed`` would only set ``prev_kind``
        now: no optimizer_update window open (nothing owed), no epoch-end validation awaiting its
        summary, no scheduler on the optimizer_update clock (each receipt would open a window).
        Then a run of them can be taken at once (:mod:`nnx_es.audit.segments`): ``prev_kind`` = the last one's."""
        return not self.owed and self.validation is None and not self.update_clocked

    # --- dispatch -------------------------------------------------------------------

    def feed(self, seq: int, event: Event, folded: Folded) -> None:
        """Check ``event`` at ``seq``; ``folded.p``: the projections folded through it (read only where needed)."""
        kind = event.KIND
        if self.owed and kind not in _WINDOW_KINDS:
            self._close_window()
        if self.validation is not None and kind not in ("validation_done", "epoch_summarized"):
            self.sink.add(seq, 7, "an epoch-end validation is not followed by the epoch's summary",
                          expected="epoch_summarized", found=kind)
            self.validation = None
        if kind == "microbatch_done":  # the hot path: nothing else to check
            self.prev_kind = kind
            return
        if kind == "update_committed":  # by kind: the audit may read it as a partial struct (audit.segments)
            self._receipt(seq, event.optimizer)  # type: ignore[attr-defined]
            self.prev_kind = kind
            return
        match event:
            case RunStarted(schedulers=decls, monitor=monitor, run_id=run_id):
                self.decls = {d.name: d for d in decls}
                self.steps = {d.name: 0 for d in decls}
                self.update_clocked = any(d.clock == "optimizer_update" for d in decls)
                self.monitor = monitor
                self.run_id = self.run_id or run_id
            case RunResumed():
                self.epoch, self.epoch_end = None, False
            case EpochBegan(epoch=e):
                self._missing_best()
                self.epoch, self.epoch_end, self.epoch_steps, self.summary = e, False, {}, {}
            case SchedulerStepped():
                self._stepped(seq, event)
            case ValidationDone(metrics=metrics, trigger=trigger):
                if trigger == "epoch":  # a step-cadence pass makes no decision
                    self.validation = metrics
            case EpochSummarized(epoch=e, metrics=metrics):
                self.epoch_end, self.summary = True, metrics
                if self.validation is not None:
                    self.validated[e], self.validation = self.validation, None
            case MonitorDecided():
                self._decided(seq, event)
            case HistoryAppended(record=record):
                self._history(seq, record.epoch, record.monitor_value, record.improved)
            case LastCommitted(manifest=m, epoch=e, final=final):
                manifest = self._manifest(seq, "last_committed", m)
                if manifest is not None:
                    self._last_state(seq, event, manifest, folded.p)
                d = self.decisions.get(e)
                if not final and d is not None and d[1].improved and e not in self.best_epochs:
                    self.pending_best = (seq, e, d[0])
            case BestCommitted(manifest=m):
                self._manifest(seq, "best_committed", m)
                self._best(seq, event)
            case PhaseCommitted(manifest=m):
                self._manifest(seq, "phase_committed", m)
            case CallbackCheckpointed(name=name, blob=blob):
                self._blob(seq, name, blob)
            case CheckpointPruned(manifest=m):
                self._pruned(seq, m, folded.p)
            case RowsRecorded(epoch=e, split=split, rows=n, columns=columns):
                if (problem := check_columns(n, columns)) is not None:
                    self.sink.add(seq, 4, f"rows_recorded of epoch {e} ({split}) is malformed: {problem}",
                                  expected=f"{n} records in every column", found=problem)
            case JournalPublished():
                self._journal(seq, event)
            case RunFinalized():
                self._missing_best()
            case EvaluationRecorded(manifest=m):  # the checkpoint it scored must verify
                self._manifest(seq, "evaluation_recorded", m)
            case ModelExported(manifest=m):  # the checkpoint it exported must verify, and the artifact where present
                self._manifest(seq, "model_exported", m)
                self._exported(seq, event)
            case _:
                pass
        self.prev_kind = kind

    def _receipt(self, seq: int, optimizer: str) -> None:
        """An ``update_committed`` of ``optimizer``: each optimizer_update-clock scheduler of it owes a step."""
        for name, d in self.decls.items():
            if d.clock == "optimizer_update" and d.optimizer == optimizer:
                first, n = self.owed.get(name, (seq, 0))
                self.owed[name] = (first, n + 1)

    def finish(self) -> None:
        if self.owed:
            self._close_window()
        for seq, event in self.exports.values():
            self._artifact(seq, event)
        for digest, (seq, kind, why) in self.unverified.items():
            if digest not in self.pruned:  # gone on purpose when pruned; missing otherwise
                self.sink.add(seq, 4, f"{kind} names a checkpoint that does not verify: {why}",
                              expected=f"manifest {digest} and its blobs intact", found=why)

    # --- invariant 4 ----------------------------------------------------------------

    def _manifest(self, seq: int, kind: str, digest: str) -> Manifest | None:
        if digest not in self.manifests:
            try:
                self.manifests[digest] = verify_checkpoint(self.store, digest, run_id=self.run_id or None)
            except CorruptCheckpointError as exc:
                self.manifests[digest] = None
                self.unverified[digest] = (seq, kind, str(exc))  # decided at finish(): pruned later, or missing
                return None
        return self.manifests[digest]

    def _exported(self, seq: int, event: ModelExported) -> None:
        """An export to a path supersedes the one recorded before it to the same path (the file was
        replaced on purpose): that one is noted; only each path's latest is checked, at :meth:`finish`."""
        file = os.path.realpath(event.path)  # the file it names: one reached through a linked directory too
        earlier = self.exports.get(file)
        if earlier is not None:
            self.sink.note(f"model_exported of {earlier[1].path!r} was superseded by a later export to the same "
                           f"file: not checked (seq {earlier[0]}, superseded at seq {seq})")
        self.exports[file] = (seq, event)

    def _artifact(self, seq: int, event: ModelExported) -> None:  # an artifact gone from its path is not checked
        try:
            found = file_sha256(event.path)
        except (OSError, UnsafePathError) as exc:
            self.sink.add(seq, 4, f"the {event.format} artifact {event.path!r} cannot be read to verify its digest",
                          expected=f"a regular file with SHA-256 {event.sha256}", found=str(exc))
            return
        if found is not None and found != event.sha256:
            self.sink.add(seq, 4, f"the {event.format} artifact {event.path!r} is not the file its latest export "
                          "recorded (changed since)", expected=f"SHA-256 {event.sha256}", found=f"SHA-256 {found}")

    def _pruned(self, seq: int, digest: str, p: Projections) -> None:
        """A ``checkpoint_pruned`` never names a checkpoint a pointer still needs (LAST, BEST, a kept phase)."""
        c = p.checkpoints
        named = [what for what, ptr in (("LAST", c.last), ("BEST", c.best)) if ptr is not None and ptr.manifest == digest]
        named += [f"phase {n!r}" for n, ptr in c.phases.items() if ptr.manifest == digest]
        if named:
            self.sink.add(seq, 4, f"checkpoint_pruned deletes a checkpoint {' and '.join(named)} still names",
                          expected="a checkpoint no pointer names", found=f"manifest {digest}")
        self.pruned.add(digest)

    def _journal(self, seq: int, event: JournalPublished) -> None:
        """A committed journal publication chains to the one before and its manifest and chunks verify."""
        if event.previous != self.journal_head:
            self.sink.add(seq, 4, f"journal_published of epoch {event.epoch} does not chain to the newest committed "
                          "manifest", expected=repr(self.journal_head), found=repr(event.previous))
        for problem in verify_manifest(self.store, event.manifest, epoch=event.epoch, previous=event.previous):
            self.sink.add(seq, 4, f"the history journal of epoch {event.epoch} does not verify: {problem}",
                          expected=f"manifest {event.manifest} and its chunks intact", found=problem)
        self.journal_head = event.manifest

    def _blob(self, seq: int, name: str, digest: str) -> None:
        if digest not in self.blobs:
            try:
                self.store.get(digest)
                self.blobs[digest] = True
            except CorruptCheckpointError as exc:
                self.blobs[digest] = False
                self.sink.add(seq, 4, f"callback {name!r} checkpoint blob does not verify: {exc}",
                              expected=f"blob {digest} intact", found=str(exc))

    # --- invariant 6 ----------------------------------------------------------------

    def _close_window(self) -> None:
        for name, (first, n) in sorted(self.owed.items(), key=lambda kv: kv[1][0]):
            d = self.decls[name]
            self.sink.add(
                first, 6,
                f"optimizer_update-clock scheduler {name!r} did not step after update_committed of {d.optimizer!r}",
                expected=f"{n} more scheduler_stepped({name})", found="none before the window closed",
            )
        self.owed.clear()

    def _stepped(self, seq: int, event: SchedulerStepped) -> None:
        name = event.name
        d = self.decls.get(name)
        if d is None:
            self.sink.add(seq, 6, f"scheduler {name!r} is not declared in run_started",
                          expected=" | ".join(sorted(self.decls)) or "no scheduler", found=name)
            return
        if event.clock != d.clock:
            self.sink.add(seq, 6, f"scheduler {name!r} steps on another clock than declared",
                          expected=d.clock, found=event.clock)
        expected_steps = self.steps.get(name, 0) + 1
        if event.steps != expected_steps:
            self.sink.add(seq, 6, f"scheduler {name!r} steps counter does not grow by 1",
                          expected=expected_steps, found=event.steps)
        self.steps[name] = event.steps
        if d.clock == "optimizer_update":
            first, owed = self.owed.get(name, (seq, 0))
            if self.prev_kind in ("update_skipped", "microbatch_done"):
                self.sink.add(seq, 6, f"optimizer_update-clock scheduler {name!r} stepped directly after "
                              f"{self.prev_kind}", expected=f"after update_committed of {d.optimizer!r}",
                              found=f"after {self.prev_kind}")
            elif owed == 0:
                self.sink.add(seq, 6, f"optimizer_update-clock scheduler {name!r} stepped without a pending "
                              f"update_committed of {d.optimizer!r}", expected="one step per receipt",
                              found="an extra step")
            if owed > 1:
                self.owed[name] = (first, owed - 1)
            else:
                self.owed.pop(name, None)
        else:
            if not self.epoch_end:
                self.sink.add(seq, 6, f"epoch-clock scheduler {name!r} stepped inside the epoch's update windows",
                              expected="after epoch_summarized", found=f"after {self.prev_kind or 'nothing'}")
            self.epoch_steps[name] = self.epoch_steps.get(name, 0) + 1
        if d.plateau or event.plateau is not None:
            self._plateau(seq, name, event.plateau)

    def _epoch_clock_count(self, seq: int, epoch: int) -> None:
        """Once per summarized epoch; a plateau scheduler once per epoch with a decision (it steps on it)."""
        if not self.epoch_end:
            return
        decided = epoch in self.decisions
        for name, d in self.decls.items():
            if d.clock != "epoch":
                continue
            want = (1 if decided else 0) if d.plateau else 1
            got = self.epoch_steps.get(name, 0)
            if got != want:
                why = "" if not d.plateau else " (a plateau scheduler steps on the epoch's decision)"
                self.sink.add(seq, 6, f"epoch-clock scheduler {name!r} stepped {got} times in epoch {epoch}{why}",
                              expected=f"{want} step{'s' if want != 1 else ''}", found=f"{got} steps")

    # --- invariant 7 ----------------------------------------------------------------

    def _val_monitor(self) -> bool:
        return self.monitor is not None and self.monitor.name.startswith("val_")

    def _decided(self, seq: int, d: MonitorDecided) -> None:
        e = d.epoch
        spec = self.monitor
        if e in self.decisions:
            self.sink.add(seq, 7, f"second monitor decision for epoch {e}",
                          expected=f"one decision (the first is at seq {self.decisions[e][0]})", found="two")
            return
        self.decisions[e] = (seq, d)
        if spec is None:
            self.sink.add(seq, 7, "monitor_decided but run_started declares no monitor", found=d.monitor)
            return
        if self.epoch is not None and e != self.epoch:
            self.sink.add(seq, 7, "monitor_decided for another epoch than the current one",
                          expected=self.epoch, found=e)
        if d.monitor != spec.name or d.mode != spec.mode:
            self.sink.add(seq, 7, "monitor_decided is not about the declared monitor",
                          expected=f"{spec.name} ({spec.mode})", found=f"{d.monitor} ({d.mode})")
        source: dict[str, float] | None = self.validated.get(e) if self._val_monitor() else self.summary
        if self._val_monitor() and source is None:
            self.sink.add(seq, 7, f"monitor_decided on {spec.name} for epoch {e}, which was not validated",
                          expected="no decision", found="a decision")
        elif source is not None and spec.name in source and not same_float(source[spec.name], d.value):
            self.sink.add(seq, 7, f"decision value differs from the epoch's {spec.name}",
                          expected=source[spec.name], found=d.value)
        self._coherent(seq, d, spec)
        self.prev_decision = d

    def _coherent(self, seq: int, d: MonitorDecided, spec: MonitorSpec) -> None:
        prev = self.prev_decision
        if d.improved:
            want = (d.value, d.epoch, 0)
            if prev is not None and not improves(d.value, prev.best, spec.mode, spec.min_delta):
                self.sink.add(seq, 7, f"decision says improved but {d.value!r} is not better than the best so far",
                              expected=f"{spec.mode} better than {prev.best!r} by {spec.min_delta!r}", found=d.value)
        elif prev is not None:
            want = (prev.best, prev.best_epoch, prev.bad_epochs + 1)
            if improves(d.value, prev.best, spec.mode, spec.min_delta):
                self.sink.add(seq, 7, f"decision says not improved but {d.value!r} beats the best so far",
                              expected="improved=true", found="improved=false")
        else:
            return
        found = (d.best, d.best_epoch, d.bad_epochs)
        if not (same_float(want[0], found[0]) and want[1:] == found[1:]):
            self.sink.add(seq, 7, "decision's best / best_epoch / bad_epochs disagree with its history",
                          expected=f"best={want[0]!r} best_epoch={want[1]} bad_epochs={want[2]}",
                          found=f"best={found[0]!r} best_epoch={found[1]} bad_epochs={found[2]}")

    def _history(self, seq: int, epoch: int, value: float | None, improved: bool | None) -> None:
        self._epoch_clock_count(seq, epoch)
        d = self.decisions.get(epoch)
        if d is None:
            if self._val_monitor() and epoch in self.validated:
                self.sink.add(seq, 7, f"validated epoch {epoch} has no monitor decision",
                              expected=f"monitor_decided(epoch={epoch})", found="none")
            if value is not None or improved is not None:
                self.sink.add(seq, 7, f"history of epoch {epoch} records a decision that was not made",
                              expected="monitor_value=null improved=null", found=f"{value!r} {improved!r}")
        elif not same_float(value, d[1].value) or improved != d[1].improved:
            self.sink.add(seq, 7, f"history of epoch {epoch} disagrees with its monitor decision",
                          expected=f"{d[1].value!r} improved={d[1].improved}", found=f"{value!r} improved={improved}")

    def _best(self, seq: int, b: BestCommitted) -> None:
        d = self.decisions.get(b.epoch)
        if d is None or not d[1].improved:
            self.sink.add(seq, 7, f"best_committed for epoch {b.epoch} without an improving monitor decision",
                          expected=f"monitor_decided(epoch={b.epoch}, improved=true) before it",
                          found="no decision" if d is None else f"decision at seq {d[0]}: improved=false")
        elif not same_float(b.value, d[1].value) or b.monitor != d[1].monitor:
            self.sink.add(seq, 7, f"best_committed for epoch {b.epoch} disagrees with the decision",
                          expected=f"{d[1].monitor}={d[1].value!r}", found=f"{b.monitor}={b.value!r}")
        self.best_epochs.add(b.epoch)
        if self.pending_best is not None and self.pending_best[1] == b.epoch:
            self.pending_best = None

    def _missing_best(self) -> None:
        if self.pending_best is not None:
            last_seq, e, dseq = self.pending_best
            self.sink.add(last_seq, 7, f"epoch {e} improved (decision at seq {dseq}) but no best_committed "
                          "followed its LAST", expected=f"best_committed(epoch={e})", found="none")
            self.pending_best = None

    def _plateau(self, seq: int, name: str, plateau: PlateauState | None) -> None:
        d = self.decisions.get(self.epoch) if self.epoch is not None else None
        if d is None:
            self.sink.add(seq, 7, f"plateau scheduler {name!r} stepped before the epoch's monitor decision",
                          expected=f"monitor_decided(epoch={self.epoch}) before it", found="none")
        elif plateau is None:
            self.sink.add(seq, 7, f"plateau scheduler {name!r} stepped without its plateau state",
                          expected="plateau state", found="none")
        elif d[1].improved and not same_float(plateau.best, d[1].best):
            self.sink.add(seq, 7, f"plateau scheduler {name!r} best disagrees with the improved decision",
                          expected=d[1].best, found=plateau.best)

    # --- invariant 10 ---------------------------------------------------------------

    def _last_state(self, seq: int, last: LastCommitted, manifest: Manifest, p: Projections) -> None:
        if manifest.counters != p.counters:
            self.sink.add(seq, 10, "counters in LAST's manifest differ from the counters projection",
                          expected=p.counters, found=manifest.counters)
        if last.counters != p.counters:
            self.sink.add(seq, 10, "counters carried by last_committed differ from the counters projection",
                          expected=p.counters, found=last.counters)
        if (manifest.epoch, manifest.step) != (last.epoch, last.step):
            self.sink.add(seq, 10, "LAST's manifest is for another epoch/step than the LAST naming it",
                          expected=f"epoch={last.epoch} step={last.step}",
                          found=f"epoch={manifest.epoch} step={manifest.step}")
        if "schedulers" not in manifest.components:
            return
        try:
            stored = load_component(self.store, manifest, "schedulers")
        except CorruptCheckpointError as exc:
            self.sink.add(seq, 10, f"schedulers component of LAST's manifest does not load: {exc}")
            return
        self._schedulers(seq, stored, p)

    def _schedulers(self, seq: int, stored: Any, p: Projections) -> None:
        projected = {
            name: {
                "steps": s.steps,
                "lrs": list(s.lrs),
                "plateau": None if s.plateau is None else {
                    "best": s.plateau.best,
                    "num_bad_epochs": s.plateau.num_bad_epochs,
                    "cooldown_counter": s.plateau.cooldown_counter,
                },
            }
            for name, s in p.schedulers.by_name.items()
        }
        if not isinstance(stored, dict):
            self.sink.add(seq, 10, "schedulers component of LAST's manifest is not a mapping",
                          expected="{name: {steps, lrs, plateau}}", found=type(stored).__name__)
            return
        if set(stored) != set(projected):
            self.sink.add(seq, 10, "schedulers in LAST's checkpoint differ from the projection",
                          expected=sorted(projected), found=sorted(map(str, stored)))
        for name in sorted(set(stored) & set(projected)):
            want, got = projected[name], stored[name]
            if not same_scheduler_state(want, got):
                self.sink.add(seq, 10, f"scheduler {name!r} state in LAST's checkpoint differs from the projection",
                              expected=want, found=got)

"""Checks over the whole recorded sequence, in log order (tails and discarded ranges included).

* invariant 2: the sequence is a path through :func:`nnx_es.lifecycle.compiled_table`;
* invariant 3: commit order per epoch (history -> LAST -> BEST/phase -> callback checkpoints);
* invariant 7 (early stopping): ``stop_requested(reason="early_stopping")`` follows a
  decision of its epoch that did not improve;
* invariant 8: finalization in reverse ``callback_began`` order, every begun
  callback finalized, LAST refreshed (``final=True``) after the last finalization.
* invariant 11 (data parallelism): :mod:`nnx_es.audit.digests`.

Each check is fed ``(seq, event)`` of every decodable event and keeps O(callbacks) state.
"""

from __future__ import annotations

from collections.abc import Sequence

from events.codec import EVENT_TYPES, KINDS, TYPE_CODES
from events.schema import (
    BestCommitted,
    CallbackBegan,
    CallbackCheckpointed,
    CallbackFinalized,
    EpochBegan,
    EpochSummarized,
    Event,
    HistoryAppended,
    LastCommitted,
    MonitorDecided,
    PhaseCommitted,
    RunFailed,
    RunFinalized,
    RunResumed,
    RunStarted,
    SchedulerStepped,
    StopRequested,
    TrainBegan,
)
from nnx_es.audit.report import Sink
from nnx_es.lifecycle import INITIAL, STATES, TRANSITIONS, compiled_table

__all__ = ["CommitOrderCheck", "FinalizationCheck", "LifecycleCheck"]

_STATUSES = ("completed", "stopped", "failed", "interrupted")


class LifecycleCheck:
    """Invariant 2.

    After an illegal event the machine resynchronizes with one event of
    lookahead: the candidates are the state the event leads to from states
    that accept it (the one its fields point at first), then the current state
    (the event was spurious), then, for a kind that keeps the state
    (``checkpoint_stored``), the states that accept it; the first candidate
    that accepts the next event wins. So a spurious, a missing or a displaced
    event usually yields one violation.
    """

    #: The kinds this check reads: all of them.
    KINDS = frozenset(KINDS)

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.state = INITIAL
        self.table = compiled_table()
        self.accepted: dict[str, list[str]] = {s: sorted(k for (src, k) in self.table if src == s) for s in STATES}
        # where each kind leads; a row whose destination is "=" (stay) leads back to its sources
        self.dests: dict[str, set[str]] = {}
        self.stays: dict[str, set[str]] = {}
        for (src, kind), dest in self.table.items():
            self.dests.setdefault(kind, set()).add(dest)
        for row in TRANSITIONS:
            if row["dest"] == "=":
                sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
                self.stays.setdefault(row["trigger"], set()).update(sources)
        self.candidates: list[str] | None = None  # undecided resynchronization
        # for runs of events taken at once (feed_run): (state, type code) -> next state, and
        # (state, a block of a run's codes) -> the state after it (None: an event of it is not accepted)
        self.by_code: dict[tuple[str, int], str] = {
            (src, TYPE_CODES[t]): dest for (src, kind), dest in self.table.items() for t in EVENT_TYPES if t.KIND == kind
        }
        self.runs: dict[tuple[str, bytes], str | None] = {}

    def feed_run(self, seqs: Sequence[int], events: Sequence[Event], codes: bytes) -> None:
        """:meth:`feed` each event of a run, in order (``codes``: their :data:`~events.codec.TYPE_CODES`), at once
        when every one is accepted: the state after a run is looked up (the runs of a long log repeat: a
        microbatch and its receipt), else walked code by code; a run holding an event that is not
        accepted is fed event by event, so its violations and the resynchronization are :meth:`feed`'s."""
        while self.candidates is not None:  # a resynchronization reads its next event's fields
            self.feed(seqs[0], events[0])
            seqs, events, codes = seqs[1:], events[1:], codes[1:]
            if not codes:
                return
        end: str | None = self.state
        runs = self.runs
        for k in range(0, len(codes), 64):  # blocks of a periodic run repeat
            block = codes[k:k + 64]
            key = (end, block)
            if key in runs:
                end = runs[key]
            else:
                start, table = end, self.by_code
                for code in block:
                    end = table.get((end, code))  # type: ignore[arg-type]
                    if end is None:
                        break
                if len(runs) >= 4096:
                    runs.clear()
                runs[(start, block)] = end
            if end is None:
                break
        if end is not None:
            self.state = end
            return
        for seq, event in zip(seqs, events):
            self.feed(seq, event)

    def feed(self, seq: int, event: Event) -> None:
        kind = event.KIND
        if self.candidates is not None:
            accepting = [c for c in self.candidates if (c, kind) in self.table]
            hint = self._hint(event)
            self.state = next(
                (c for c in accepting if self.table[(c, kind)] == hint),
                accepting[0] if accepting else self.candidates[0],
            )
            self.candidates = None
        nxt = self.table.get((self.state, kind))
        if nxt is not None:
            self.state = nxt
            return
        self.sink.add(
            seq,
            2,
            f"{kind} is not accepted in lifecycle state {self.state!r}",
            expected=" | ".join(self.accepted[self.state]) or "no further event",
            found=kind,
        )
        self.candidates = self._candidates(event)

    def _hint(self, event: Event) -> str | None:
        """The destination an event's fields point at, for kinds that lead to several states."""
        match event:
            case LastCommitted(final=final):
                return "closed" if final else "committed"
            case SchedulerStepped(clock=clock):
                return "updated" if clock == "optimizer_update" else "scheduled"
            case StopRequested(reason=reason):
                return "stopping" if reason == "update_boundary" else "scheduled"
            case CallbackFinalized():
                return "failed" if self.state == "failed" else "finalizing"
        return None

    def _candidates(self, event: Event) -> list[str]:
        hint = self._hint(event)
        kind = event.KIND
        stays = self.stays.get(kind, set())
        dests = self.dests.get(kind, set()) - stays
        order = [hint] if hint in dests else []
        order += sorted(dests - set(order))
        # the event's destination first (a missing event before it), then staying (a spurious
        # event), then, for an event that keeps the state, the states that accept it
        return [*order[:1], self.state, *order[1:], *sorted(stays - {self.state})]


class CommitOrderCheck:
    """Invariant 3: for each epoch, ``history_appended`` -> ``last_committed`` -> BEST/phase/callback checkpoints.

    * ``epoch_began(e)`` follows a LAST of epoch ``e - 1``;
    * ``history_appended`` records the epoch that began;
    * a non-final LAST of epoch ``e >= 0`` follows that epoch's history (the
      LAST right after ``train_began``, initial or after a resume, needs none);
    * BEST / phase / callback checkpoints of epoch ``e`` sit in the commit group
      of epoch ``e``'s LAST, and BEST / phase name LAST's manifest.
    """

    #: The kinds this check reads (the audit routes only these to it).
    KINDS = frozenset({
        "run_started", "run_resumed", "train_began", "epoch_began", "history_appended",
        "last_committed", "best_committed", "phase_committed", "callback_checkpointed",
    })

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.epoch: int | None = None  # epoch_began's epoch, in the current session
        self.history: tuple[int, int] | None = None  # (seq, epoch) awaiting its LAST
        self.last: LastCommitted | None = None
        self.last_seq = -1
        self.initial = False  # train_began seen; the next LAST is the initial one

    def feed(self, seq: int, event: Event) -> None:
        match event:
            case RunStarted() | RunResumed():
                self.history = None
                self.epoch = None
                self.initial = False
            case TrainBegan():
                self.initial = True
            case EpochBegan(epoch=e):
                self._epoch_began(seq, e)
            case HistoryAppended(record=record):
                if self.epoch is not None and record.epoch != self.epoch:
                    self.sink.add(
                        seq, 3, "history_appended records another epoch than the one that began",
                        expected=f"epoch {self.epoch}", found=f"epoch {record.epoch}",
                    )
                self.history = (seq, record.epoch)
            case LastCommitted():
                self._last(seq, event)
            case BestCommitted(epoch=e, manifest=m):
                self._grouped(seq, "best_committed", e, m)
            case PhaseCommitted(epoch=e, manifest=m):
                self._grouped(seq, "phase_committed", e, m)
            case CallbackCheckpointed(epoch=e):
                self._grouped(seq, "callback_checkpointed", e, None)
            case _:
                pass

    def _epoch_began(self, seq: int, e: int) -> None:
        """The next epoch follows LAST's epoch, or, with a deferred LAST, the recorded one."""
        self.epoch = e
        self.initial = False
        if self.history is not None:  # the previous epoch's LAST is deferred (in flight)
            want, why = self.history[1] + 1, f"history_appended at seq {self.history[0]} is epoch {self.history[1]}"
        elif self.last is not None and not self.last.final:
            want, why = self.last.epoch + 1, f"LAST at seq {self.last_seq} is epoch {self.last.epoch}"
        else:
            return
        if e != want:
            self.sink.add(seq, 3, f"epoch_began for epoch {e} does not follow the epoch before it",
                          expected=f"epoch {want} ({why})", found=f"epoch {e}")

    def _last(self, seq: int, event: LastCommitted) -> None:
        e = event.epoch
        if event.final:
            if self.history is not None:
                self.sink.add(
                    seq, 3, f"history of epoch {self.history[1]} (seq {self.history[0]}) is committed by a final LAST",
                    expected="last_committed(final=false)", found="last_committed(final=true)",
                )
        elif self.initial:
            pass  # the LAST right after train_began: initial or after a resume, no history of its own
        elif e >= 0:
            if self.history is None:
                self.sink.add(
                    seq, 3, f"last_committed for epoch {e} without its history_appended before it",
                    expected=f"history_appended(epoch={e}) before seq {seq}", found="none",
                )
            elif self.history[1] != e:
                self.sink.add(
                    seq, 3, f"last_committed for epoch {e} follows the history of another epoch",
                    expected=f"history_appended(epoch={e})",
                    found=f"history_appended(epoch={self.history[1]}) at seq {self.history[0]}",
                )
            elif 0 <= event.covers < self.history[0]:
                self.sink.add(
                    seq, 3, f"deferred last_committed for epoch {e} does not cover its history_appended",
                    expected=f"covers >= {self.history[0]}", found=f"covers={event.covers}",
                )
        self.history = None
        self.initial = False
        self.last = event
        self.last_seq = seq

    def _grouped(self, seq: int, kind: str, epoch: int, manifest: str | None) -> None:
        last = self.last
        if last is None or last.final or last.epoch != epoch:
            self.sink.add(
                seq, 3, f"{kind} for epoch {epoch} is not in the commit group of that epoch's LAST",
                expected=f"after last_committed(epoch={epoch})",
                found="no LAST before it" if last is None
                else f"last_committed(epoch={last.epoch}{', final' if last.final else ''}) at seq {self.last_seq}",
            )
        elif manifest is not None and manifest != last.manifest:
            self.sink.add(
                seq, 3, f"{kind} for epoch {epoch} names another manifest than that epoch's LAST",
                expected=last.manifest, found=manifest,
            )


class FinalizationCheck:
    """Invariant 8 per session (``run_started`` / ``run_resumed`` to ``run_finalized``),
    and invariant 7's early-stopping rule (it needs the session's last decision)."""

    #: The kinds this check reads (the audit routes only these to it).
    KINDS = frozenset({
        "run_started", "run_resumed", "callback_began", "callback_finalized", "last_committed",
        "monitor_decided", "stop_requested", "run_failed", "run_finalized",
    })

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self._session()

    def _session(self) -> None:
        self.began: list[CallbackBegan] = []
        self.finalized: set[int] = set()
        self.last_finalized_seq: int | None = None
        self.final_last_seq: int | None = None
        self.stop: StopRequested | None = None
        self.failed = False
        self.decision: MonitorDecided | None = None

    def feed(self, seq: int, event: Event) -> None:
        match event:
            case RunStarted() | RunResumed():
                self._session()
            case CallbackBegan():
                self.began.append(event)
            case CallbackFinalized(index=index, name=name):
                self._finalized(seq, index, name)
            case LastCommitted(final=final):
                if final:
                    self.final_last_seq = seq
                elif self.last_finalized_seq is not None:
                    self.sink.add(
                        seq, 8, "the LAST refreshed after finalization is not marked final",
                        expected="last_committed(final=true)", found="last_committed(final=false)",
                    )
                    self.final_last_seq = seq
            case MonitorDecided():
                self.decision = event
            case StopRequested(reason=reason, epoch=e, by=by):
                self.stop = event
                if reason == "early_stopping" and by != "resume":
                    # a stop re-recorded by a resumed session follows the decision of the session before
                    self._early_stop(seq, e)
            case RunFailed():
                self.failed = True
            case RunFinalized(status=status):
                self._run_finalized(seq, status)
            case _:
                pass

    def _early_stop(self, seq: int, epoch: int) -> None:
        d = self.decision
        if d is None or d.epoch != epoch:
            self.sink.add(
                seq, 7, f"early stopping in epoch {epoch} without that epoch's monitor decision",
                expected=f"monitor_decided(epoch={epoch}, improved=false) before it",
                found="none" if d is None else f"last decision is for epoch {d.epoch}",
            )
        elif d.improved:
            self.sink.add(
                seq, 7, f"early stopping in epoch {epoch} after a decision that improved",
                expected="improved=false", found="improved=true",
            )

    def _expected_next(self) -> CallbackBegan | None:
        for cb in reversed(self.began):
            if cb.index not in self.finalized:
                return cb
        return None

    def _finalized(self, seq: int, index: int, name: str) -> None:
        begun = {cb.index: cb for cb in self.began}
        cb = begun.get(index)
        if cb is None:
            self.sink.add(
                seq, 8, f"callback {name!r} (index {index}) is finalized but never began in this session",
                expected=" | ".join(f"{c.name}#{c.index}" for c in self.began) or "no callback", found=f"{name}#{index}",
            )
        elif index in self.finalized:
            self.sink.add(seq, 8, f"callback {name!r} (index {index}) is finalized twice", found=f"{name}#{index}")
        else:
            expected = self._expected_next()
            if expected is not None and expected.index != index:
                self.sink.add(
                    seq, 8, "callbacks are not finalized in reverse order of callback_began",
                    expected=f"{expected.name}#{expected.index}", found=f"{name}#{index}",
                )
            if cb.name != name:
                self.sink.add(
                    seq, 8, f"callback_finalized index {index} names another callback than its callback_began",
                    expected=cb.name, found=name,
                )
            self.finalized.add(index)
        self.last_finalized_seq = seq

    def _run_finalized(self, seq: int, status: str) -> None:
        for cb in self.began:
            if cb.index not in self.finalized:
                self.sink.add(
                    seq, 8, f"callback {cb.name!r} (index {cb.index}) began but was never finalized",
                    expected=f"callback_finalized({cb.name}#{cb.index}) before run_finalized", found="none",
                )
        if status not in _STATUSES:
            self.sink.add(seq, 8, "run_finalized has an unknown status", expected=" | ".join(_STATUSES), found=status)
        elif (status in ("failed", "interrupted")) != self.failed:
            self.sink.add(
                seq, 8, f"run_finalized status {status!r} disagrees with the session's run_failed",
                expected="failed | interrupted" if self.failed else "completed | stopped", found=status,
            )
        elif status == "stopped" and self.stop is None:
            self.sink.add(seq, 8, "run_finalized status 'stopped' without a stop_requested",
                          expected="stop_requested before it", found="none")
        update_boundary = status == "stopped" and self.stop is not None and self.stop.reason == "update_boundary"
        if status in ("completed", "stopped") and not update_boundary:
            after = self.last_finalized_seq if self.last_finalized_seq is not None else -1
            if self.final_last_seq is None or self.final_last_seq < after:
                self.sink.add(
                    seq, 8, f"a {status} run ends without LAST refreshed after finalization",
                    expected=f"last_committed(final=true) after seq {after}" if after >= 0
                    else "last_committed(final=true) before run_finalized",
                    found="none",
                )

"""Audit one run directory against the eleven invariants of docs/INVARIANTS.md, in one streaming pass.

The pass reads ``events.lmdb`` read-only (so it works beside a live writer) up
to the length it had when opened:

1. ``read_raw`` checks that the keys run 0, 1, 2, ... and decodes each value (invariant 1):
   a key out of place is named as a changed key when the key after it is back in sequence
   (its value is then read as the seq of its place), else as a gap, a duplicate or a key out
   of order, and the sequence goes on from the key found (one damaged key, one violation);
   the checksums are verified in a second read (:meth:`~events.log.LmdbLog.verify_sums`);
2. each decodable event feeds the sequence checks (invariants 2, 3, 8 and
   the early-stopping rule of 7, :mod:`nnx_es.audit.sequence`);
3. the same stream goes through :func:`projections.committed`; each committed
   event is folded into the projections and fed to the committed-view checks
   (invariants 4, 6, 7, 10, :mod:`nnx_es.audit.committed`).

Each projection snapshot stored (:mod:`projections.snapshots`) is compared, at its seq, with
the fold of the same pass (invariant 9: a materialized projection; an unusable one is a note).

Invariant 5 then re-reads what follows the last point where the committed
view held nothing back (the last LAST when commits are not deferred: O(tail),
not O(run)), re-projects the committed prefix from there and compares it with
the projection of the whole log; invariant 9 compares the view files byte for
byte with :func:`nnx_es.views.expected_views`. Memory is what
:func:`projections.committed` holds back (about one epoch), like
:func:`projections.project`.

Beside a live writer the log is audited as it was when opened; view files the
writer rewrote since may then be newer than that log (an invariant 9 report).
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from events.codec import KINDS, decode
from events.errors import CorruptEventError, SequenceGapError
from events.log import LmdbLog
from events.schema import Event, RunStarted
from events.sums import SumProblem
from nnx_es.audit.committed import CommittedCheck
from nnx_es.audit.fold import CommittedFold
from nnx_es.audit.reading import decoded, open_run_log
from nnx_es.audit.report import AuditReport, Sink
from nnx_es.audit.segments import run_segments
from nnx_es.audit.digests import DigestCheck
from nnx_es.audit.sequence import CommitOrderCheck, FinalizationCheck, LifecycleCheck
from nnx_es.audit.snapshots import SnapshotCheck
from nnx_es.audit.spec import SpecHashCheck
from nnx_es.audit.world import WorldCheck
from nnx_es.resume import renamed_run_problem
from nnx_es.storage import BlobStore
from nnx_es.views import expected_views, read_views
from projections import Projections, project, tail_length

__all__ = ["audit_run"]

_FIELDS = ("history", "checkpoints", "schedulers", "counters", "status")


class _Source:
    """The raw pass: invariant 1, then the sequence checks; yields the decodable events."""

    def __init__(self, log: LmdbLog, stop: int, sink: Sink) -> None:
        self.log, self.stop, self.sink = log, stop, sink
        self.events = 0
        self.run_started: RunStarted | None = None
        self.checks = (LifecycleCheck(sink), CommitOrderCheck(sink), FinalizationCheck(sink), DigestCheck(sink),
                       SpecHashCheck(sink), WorldCheck(sink))

    def __iter__(self) -> Iterator[tuple[int, Event]]:
        expected, previous = 0, None  # the seq due next, the key before
        routes: dict[str, list[Callable[[int, Event], None]]] = {
            kind: [c.feed for c in self.checks if kind in c.KINDS] for kind in KINDS
        }
        # the first ``stop`` entries, by position: a changed key past ``stop`` must not end the pass
        stored = itertools.chain(itertools.islice(self.log.read_raw(0), self.stop), [(None, b"")])
        for (key, raw), (following, _) in itertools.pairwise(stored):
            self.events += 1
            seq = key
            if key != expected:
                problem = SequenceGapError(expected, key, previous, following)
                self.sink.add(expected if problem.kind == "changed" else key, 1, str(problem),
                              expected=f"seq {expected}", found=f"seq {key}")
                if problem.kind == "changed":  # one key changed: its value is read as the seq of its place
                    seq = expected
            expected, previous = seq + 1, key
            try:
                event = decode(raw, seq)
            except CorruptEventError as exc:
                self.sink.add(seq, 1, f"value does not decode to a known event: {exc.reason}",
                              expected="a known event", found=f"{len(raw)} bytes {raw[:16].hex()}")
                continue
            if self.run_started is None and type(event) is RunStarted:
                self.run_started = event
            for feed in routes[event.KIND]:
                feed(seq, event)
            yield seq, event


def audit_run(run_dir: Path) -> AuditReport:
    """Check every invariant of docs/INVARIANTS.md on ``run_dir`` (``runs/<id>``) and name each violation.

    Raises:
        NotARunError: the directory is missing or holds no ``events.lmdb``.
        EventLogError: the log cannot be opened or read.
        UnsafePathError: a symbolic link, a FIFO or a device under the run (its log, blob or view
            directory, a blob, a view): refused, never followed or read (:mod:`events.paths`).
    """
    run_dir = Path(run_dir)
    log = open_run_log(run_dir)
    try:
        return _audit(run_dir, log)
    finally:
        log.close()


def _audit(run_dir: Path, log: LmdbLog, parallel: bool | None = None) -> AuditReport:
    """The pass a segment at a time (:mod:`nnx_es.audit.segments`), or, on a log it does not cover
    (a key out of place, a value that does not decode, a checksum problem), event by event."""
    stop = log.next_seq  # a live writer may append meanwhile: audit what was there when opened
    sink = Sink()
    store = BlobStore(run_dir / "blobs", log=log)
    done = run_segments(run_dir, log, stop, sink, store, parallel)
    if done is None:
        return _audit_by_event(run_dir, log, stop)
    folded, snapshots, problems = done
    tail = _check_tail(log, sink, folded, stop)
    notes = [*snapshots.notes, *_check_sums(iter(problems), sink, stop)]
    return _report(run_dir, sink, folded.p, stop, tail, notes)


def _report(run_dir: Path, sink: Sink, p: Projections, events: int, tail: int, notes: list[str]) -> AuditReport:
    _check_views(run_dir, sink, p)
    last = p.checkpoints.last
    violations = sink.sorted()
    if p.status.run_id and p.status.run_id != run_dir.resolve().name:  # intact, but not resumable as it stands
        notes = [*notes, renamed_run_problem(run_dir, p.status.run_id)]
    return AuditReport(
        ok=not violations,
        run_id=p.status.run_id or run_dir.name,
        status=p.status.status,
        events=events,
        committed_epoch=last.epoch if last is not None and last.epoch >= 0 else None,
        tail=tail,
        violations=violations,
        notes=[*notes, *sink.notes],
    )


def _audit_by_event(run_dir: Path, log: LmdbLog, stop: int) -> AuditReport:
    """The pass event by event: the reference for a damaged log (module docstring)."""
    sink = Sink()
    source = _Source(log, stop, sink)
    check = CommittedCheck(sink, BlobStore(run_dir / "blobs", log=log), run_id="")
    folded = CommittedFold(source)
    snapshots = SnapshotCheck(log, stop, sink)
    for seq, event, state in folded:
        if not check.run_id:  # manifests are verified against the run they belong to
            check.run_id = source.run_started.run_id if source.run_started is not None else run_dir.name
        check.feed(seq, event, state)
        if seq >= snapshots.next_seq or folded.last_read > snapshots.next_seq:
            snapshots.feed(seq, event, folded.read == folded.yielded and not folded.exhausted, folded.last_read,
                           state)
    check.finish()
    snapshots.finish()
    p = folded.p
    tail = _check_tail(log, sink, folded, stop)
    notes = [*snapshots.notes, *_check_sums(log.verify_sums(stop), sink, stop)]
    return _report(run_dir, sink, p, source.events, tail, notes)


def _check_sums(problems: Iterator[SumProblem], sink: Sink, stop: int) -> list[str]:
    """Invariant 1's checksums: every stored value is covered by a sum record whose CRC-32 matches.

    Returns the notes: values before the first sum record were written before
    checksums existed (not verified, not a violation). Values a record names but the
    log does not hold are a violation only past the log's end (it lost its last
    events): a hole inside is already a sequence gap.
    """
    notes = []
    for first, last, problem, expected, found in problems:
        span = f"values seq {first}..{last}"
        match problem:
            case "mismatch":
                sink.add(first, 1, f"{span} do not match their checksum: a byte changed on disk",
                         expected=f"CRC-32 {expected:08x}", found=f"CRC-32 {found:08x}")
            case "missing" if last >= stop:
                sink.add(stop, 1, f"{span} were written together, the log ends at seq {stop - 1}: "
                         "it lost its last events", expected=f"{expected} values", found=f"{found}")
            case "stray":
                sink.add(first, 1, f"{span} are covered by no checksum record (a lost record, or "
                         "values written outside the log's writer)", expected="a sum record",
                         found=f"{found} values without one")
            case "malformed":
                sink.add(first, 1, f"the checksum record at seq {first} ends before it starts or "
                         "overlaps the one before it: a byte of it changed on disk")
            case "uncovered":
                notes.append(f"{span} ({found} events) were written before checksums existed: "
                             "not verified against bit rot")
    return notes


def _encoded(p: Projections) -> dict[str, bytes]:
    return {name: msgspec.msgpack.encode(getattr(p, name)) for name in _FIELDS}


def _check_tail(log: LmdbLog, sink: Sink, folded: CommittedFold, stop: int) -> int:
    """Invariant 5; returns the tail length (events the committed view leaves out).

    When the view held events back, the events after its last restart point are
    read again (O(tail) when commits are not deferred): their tail length
    (:func:`projections.tail_length`) must match the pass's count, and
    re-projecting the prefix up to the highest committed seq from the restart
    point must give the projection of the whole log. Closing events folded from
    a finalized tail may change the status and nothing else.
    """
    if folded.last_read == folded.restart_seq:
        return 0  # the view held nothing back
    tail = tail_length(decoded(log, folded.restart_seq + 1, stop))
    if tail != folded.tail:
        sink.add(None, 5, "tail length disagrees with the committed view",
                 expected=f"{folded.tail} uncommitted events", found=f"{tail}")
    p = folded.p
    prefix = project(decoded(log, folded.restart_seq + 1, folded.max_seq + 1), start=folded.restart)
    whole, part = _encoded(p), _encoded(prefix)
    differ = [name for name in _FIELDS if whole[name] != part[name]]
    if differ:
        sink.add(None, 5, "the uncommitted tail changes the projections",
                 expected=f"projection of events 0..{folded.max_seq}", found=f"{', '.join(differ)} differ")
    if folded.closing:
        before = _encoded(folded.before_closing)
        changed = [name for name in _FIELDS if name != "status" and whole[name] != before[name]]
        if changed:
            sink.add(None, 5, f"closing events of the finalized tail changed {', '.join(changed)}",
                     expected="only the status changes", found=f"{', '.join(changed)} changed")
    return tail


def _check_views(run_dir: Path, sink: Sink, p: Projections) -> None:
    """Invariant 9: each view file present equals the projection, byte for byte."""
    expected = expected_views(p)
    present = read_views(run_dir, {rel: len(want) for rel, want in expected.items()})
    for rel, want in expected.items():
        got = present.get(rel)
        if got is None or got == want:
            continue
        want_lines = want.decode("utf-8", "replace").splitlines()
        got_lines = got.decode("utf-8", "replace").splitlines()
        where, exp, fnd = _first_difference(want_lines, got_lines)
        sink.add(None, 9, f"{rel} differs from the projection at line {where}", expected=exp, found=fnd)


def _first_difference(want: list[str], got: list[str]) -> tuple[int, str, str]:
    for op, i1, _i2, j1, _j2 in difflib.SequenceMatcher(a=want, b=got, autojunk=False).get_opcodes():
        if op != "equal":
            exp = want[i1] if i1 < len(want) else "<end of file>"
            fnd = got[j1] if j1 < len(got) else "<end of file>"
            return j1 + 1, exp, fnd
    return 1, "identical lines", "different bytes (line endings or encoding)"

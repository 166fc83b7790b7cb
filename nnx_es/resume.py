"""Finding and verifying a run's resume point (its last durable LAST commit).

The resume point is read from the log's committed view; the manifest and every
blob it names are SHA-256-verified before anything is restored. An empty,
torn, corrupt or mixed LAST is refused with a named reason: it is never read as
"no history", so a bad resume point can never erase a run (spec 000, failure
semantics). The log's checksums (:mod:`events.sums`) are verified first: a run
whose stored bytes changed on disk is refused, never continued (one more read of
the log and one CRC-32 pass over its bytes, once per resume).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import structlog

from events.codec import decode_many
from events.errors import CorruptEventError, SequenceGapError
from events.log import LmdbLog
from events.schema import LastCommitted, RunStarted
from events.specs import spec_hash_problem
from nnx_es.checkpoint import Manifest, verify_checkpoint
from nnx_es.errors import CorruptCheckpointError, ResumeError
from nnx_es.lifecycle import compiled_table
from nnx_es.storage import BlobStore
from projections.checkpoints import CheckpointsState
from projections.commits import GroupTracker
from projections.snapshots import Snapshot, Unusable, decode_snapshot
from projections.view import Projections, committed, fold

_log = structlog.get_logger("nnx_es")

__all__ = ["ResumePoint", "find_resume_point", "renamed_run_problem"]


class ResumePoint(msgspec.Struct, kw_only=True):
    """Where a run continues from.

    last_seq: seq of the LAST commit; discard_from / discard_to: the uncommitted
    tail (``[from, to)``) the resume abandons; state: the lifecycle state the
    log ended in; projections: the committed view's projections.
    """

    run_id: str
    manifest_hash: str
    manifest: Manifest
    last_seq: int
    discard_from: int
    discard_to: int
    state: str
    projections: Projections
    started: RunStarted | None = None
    #: the projection snapshot the committed view was folded from (None: from seq 0); the resumed
    #: session's own snapshots continue from it (:class:`nnx_es.runtime.recording.Recorder`)
    snapshot: Snapshot | None = None


class _Scan:
    """What :func:`_scan` learns of a log in its one pass (see there)."""

    __slots__ = ("state", "started", "boundary", "session", "lasts")

    def __init__(self) -> None:
        #: the lifecycle state the log ends in
        self.state = "new"
        #: the log's first ``run_started``
        self.started: RunStarted | None = None
        #: the last seq the committed prefix reaches: a LAST, its group, or a ``run_resumed``
        self.boundary = -1
        #: the seq of the last ``run_resumed`` (-1: none)
        self.session = -1
        #: every ``(seq, LAST)``, in seq order (one per epoch: small)
        self.lasts: list[tuple[int, LastCommitted]] = []


def _scan(run_dir: Path, log: LmdbLog) -> _Scan:
    """One streaming pass over ``log``: every key, every value decoded and checksummed (invariant
    1), the lifecycle state it ends in, and where its committed prefix ends.

    Memory is bounded by a chunk of the log and the LASTs, whatever the run's length (issue 14:
    a resume never holds the log in memory). The keys are checked first, by themselves
    (``check_keys``: the chunked read derives seqs from chunk boundaries, and the checksums cover
    values only, so a changed key is seen by neither); a value that does not decode is named
    before any checksum problem, as when the log was read whole.

    Raises:
        ResumeError: a key out of place, a value that does not decode, a checksum problem.
    """
    try:
        log.check_keys()
    except SequenceGapError as exc:
        raise ResumeError(f"cannot resume {run_dir}: its event log has a {exc}; nothing was restored or written") from exc
    scan = _Scan()
    table = compiled_table()
    group = GroupTracker()

    def each_chunk(first: int, values: list[bytes]) -> None:
        state, boundary, see = scan.state, scan.boundary, group.see
        for seq, event in zip(range(first, first + len(values)), decode_many(values, first)):
            kind = event.KIND
            state = table.get((state, kind), state)
            if see(kind):  # a LAST or its group: the committed prefix reaches here
                boundary = seq
                if kind == "last_committed":  # never pending: every LAST is committed
                    scan.lasts.append((seq, event))  # type: ignore[arg-type]
            elif kind == "run_resumed":
                boundary = scan.session = seq
            elif kind == "run_started" and scan.started is None:
                scan.started = event  # type: ignore[assignment]
        scan.state, scan.boundary = state, boundary

    try:
        problems = list(log.verify_sums(each_chunk=each_chunk))
    except CorruptEventError as exc:
        raise ResumeError(f"cannot resume {run_dir}: {exc}; nothing was restored or written") from exc
    for first, last, problem, _, _ in problems:
        if problem != "uncovered":  # values of a log older than checksums are read unverified
            why = _SUM_PROBLEMS[problem]
            raise ResumeError(f"cannot resume {run_dir}: its event log's values seq {first}..{last} {why}; "
                              "nothing was restored or written")
    return scan


_SUM_PROBLEMS = {
    "mismatch": "do not match their checksum (a byte changed on disk)",
    "missing": "were written together and some are missing",
    "stray": "are covered by no checksum record",
    "malformed": "have a malformed checksum record",
}


def renamed_run_problem(run_dir: Path, run_id: str) -> str:
    """What a run directory named other than its run's id (copied or renamed: ``cp -a runs/a runs/a-backup``)
    is, and what to do: a stateful resume continues a run under the id it was started with (its
    checkpoints and lease name it), so such a copy cannot be resumed as is (``nnx-es resume`` refuses it,
    ``nnx-replay`` notes it)."""
    name = run_dir.resolve().name
    return (f"the directory {str(run_dir)!r} is named {name!r}, not after its run: the run in it was started "
            f"with run id {run_id!r} (the directory was copied or renamed), and a stateful resume continues a "
            f"run only under its own id. Resume it under its own name (put it in another runs root as "
            f"{run_id!r}, e.g. cp -a {str(run_dir)!r} OTHER_ROOT/{run_id}, then nnx-es resume OTHER_ROOT/{run_id}),"
            f" or fork a new run from it (nnx-es resume {str(run_dir)!r} --from best|SEQ --run-id NEW, or "
            "fit(resume_from=..., resume_mode='fork'))")


def find_resume_point(run_dir: Path, log: LmdbLog, *, expect_run_id: str | None = None,
                      at: int | str | None = None) -> ResumePoint:
    """Locate and verify the LAST commit of the run whose log is ``log``.

    ``at``: another committed LAST than the latest -- its seq, or ``"best"`` (the latest LAST
    naming BEST's manifest): where a new run forks from (the projections stay the latest's).

    The log is read as a stream, twice, never held whole (issue 14: the training process's memory
    does not grow with the run's length): :func:`_scan` checks every key, value and checksum and
    finds the committed prefix's end; then the committed view is folded from the newest usable
    projection snapshot at or below that end (:mod:`projections.snapshots`: a damaged one is
    skipped with a warning, never trusted), or from seq 0 without one -- the same projections
    either way (tested).

    Raises:
        ResumeError: the log's keys are not 0, 1, 2, ... (a gap, a duplicate or a key out
            of order) or a value does not decode (invariant 1: the seq is named), ``run_started.spec`` does not
            hash to its ``spec_hash``, no LAST commit, or the LAST checkpoint is missing, empty, torn, corrupt
            or mixed (the reason is named).
        EventLogError: LMDB cannot read the log.
    """
    scan = _scan(run_dir, log)
    problem = spec_hash_problem(scan.started.spec, scan.started.spec_hash) if scan.started is not None else None
    if problem is not None:  # a spec rewritten after it was written: the run is not the one it says (docs/SECURITY.md)
        raise ResumeError(f"cannot resume {run_dir}: {problem}; nothing was restored or written")
    if expect_run_id is not None and scan.started is not None and scan.started.run_id != expect_run_id:
        raise ResumeError(f"cannot resume statefully: {renamed_run_problem(Path(run_dir), scan.started.run_id)}; "
                          "nothing was restored or written")
    run_id = expect_run_id or (scan.started.run_id if scan.started is not None else None)
    if not scan.lasts:
        raise ResumeError(f"run at {run_dir} has no committed LAST checkpoint to resume from")
    proj, discard_from, snapshot = _committed_prefix(log, scan.boundary, scan.session, scan.lasts)
    last = scan.lasts[-1] if at is None else _chosen_last(run_dir, scan.lasts, at, proj)
    seq, event = last
    pruned = proj.checkpoints.pruned.get(event.manifest)
    if pruned is not None:
        kept, _ = kept_lasts(scan.lasts, proj)
        raise ResumeError(
            f"LAST (seq {seq}, epoch {event.epoch}) is refused: checkpoint retention pruned it ({pruned}); "
            f"start from a kept checkpoint -- the LASTs at seqs {kept} (the latest, BEST's and phase checkpoints' "
            "among them) -- or train with keep_last=None to keep every one; nothing was restored"
        )
    store = BlobStore(Path(run_dir) / "blobs", log=log)
    try:
        manifest = verify_checkpoint(store, event.manifest, run_id=run_id)
    except CorruptCheckpointError as exc:
        raise ResumeError(
            f"LAST (seq {seq}, manifest {event.manifest}) is refused: {exc}; "
            "the run's history is kept, nothing was restored"
        ) from exc
    return ResumePoint(
        run_id=run_id or Path(run_dir).name,
        manifest_hash=event.manifest,
        manifest=manifest,
        last_seq=seq,
        discard_from=discard_from,
        discard_to=log.next_seq,
        state=scan.state,
        projections=proj,
        started=scan.started,
        snapshot=snapshot,
    )


def _committed_prefix(log: LmdbLog, boundary: int, session: int,
                      lasts: list[tuple[int, LastCommitted]]) -> tuple[Projections, int, Snapshot | None]:
    """The projections of the log's committed view up to ``boundary``, and the first seq after the
    last resume (``session``) that the view leaves out -- where the new session's discarded range
    begins: after the boundary, or earlier when a deferred LAST left the events between its
    ``covers`` and itself pending; and the snapshot it started from (None: seq 0).

    Starts from the newest usable snapshot at or below ``boundary``: there the view holds nothing
    back, so every seq after ``session`` up to the snapshot is in it. A snapshot whose checksum
    verifies is still checked against the LASTs the scan read (``lasts``: every one is committed):
    it must have folded exactly those at or below its seq, the newest as its LAST; one that does
    not (an older point's state under its key) is skipped with a note like a damaged one, since
    what a resume folds goes on into its own snapshots and views.
    """
    notes: list[str] = []
    snapshot = None
    for seq, value in log.read_snapshots(boundary + 1):  # newest first
        found = decode_snapshot(seq, value)
        if isinstance(found, Snapshot):
            why = _disagrees(found.projections.checkpoints, [e for s, e in lasts if s <= seq])
            if why is None:
                snapshot = found
                break
            found = Unusable(seq, why)
        notes.append(found.note())
    for note in notes:
        _log.warning(note, log=str(log.path))
    if snapshot is None:
        proj, start, in_group = Projections(), 0, False
    else:
        proj, start, in_group = snapshot.projections, snapshot.seq + 1, snapshot.in_group
    expected = max(session, start - 1) + 1  # the first seq after the last resume not yet seen kept
    ahead: set[int] = set()  # kept seqs past a gap (a finalized run's closing events come out of order)
    for seq, event in committed(log.read(start), in_group=in_group):
        if seq > boundary:
            break
        if seq == expected:
            expected += 1
            while expected in ahead:
                ahead.remove(expected)
                expected += 1
        elif seq > expected:
            ahead.add(seq)
        proj = fold(proj, seq, event)
    return proj, expected, snapshot


def _disagrees(pointers: CheckpointsState, lasts: list[LastCommitted]) -> str | None:
    """Why a snapshot's checkpoint pointers disagree with the log's ``lasts`` up to its seq, or None."""
    last = pointers.last
    if pointers.commits != len(lasts):
        return f"it folds {pointers.commits} LAST commits, the log holds {len(lasts)} at or before its seq"
    if lasts and (last is None or (last.manifest, last.epoch, last.step) !=
                  (lasts[-1].manifest, lasts[-1].epoch, lasts[-1].step)):
        return "its LAST is not the log's LAST at its seq"
    return None


def _chosen_last(run_dir: Path, lasts: list[tuple[int, LastCommitted]], at: int | str,
                 proj: Projections) -> tuple[int, LastCommitted]:
    """The committed LAST ``at`` names (a seq, or ``"best"``).

    Raises:
        ResumeError: no committed LAST at that seq (the committed ones named), or no BEST.
    """
    if at == "best":
        best = proj.checkpoints.best
        chosen = [x for x in lasts if best is not None and x[1].manifest == best.manifest]
        if not chosen:
            raise ResumeError(f"run at {run_dir} has no committed BEST checkpoint to start from")
        return chosen[-1]
    if isinstance(at, bool) or not isinstance(at, int):
        raise ResumeError(f"resume_at must be a LAST's seq or 'best', got {at!r}")
    for x in lasts:
        if x[0] == at:
            return x
    kept, pruned = kept_lasts(lasts, proj)
    raise ResumeError(f"run at {run_dir} has no committed LAST at seq {at}; the committed LASTs it keeps are at "
                      f"{kept}" + (f" ({pruned} more were pruned by checkpoint retention)" if pruned else ""))


def kept_lasts(lasts: list[tuple[int, LastCommitted]], proj: Projections) -> tuple[list[int], int]:
    """The seqs of the committed LASTs whose checkpoint retention kept (the latest, BEST's, phase
    checkpoints', ``keep_last``'s), and how many others it pruned."""
    kept = [seq for seq, event in lasts if event.manifest not in proj.checkpoints.pruned]
    return kept, len(lasts) - len(kept)

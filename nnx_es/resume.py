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

from events.errors import CorruptEventError, SequenceGapError
from events.log import EventLog
from events.schema import Event, LastCommitted, RunStarted
from nnx_es.checkpoint import Manifest, verify_checkpoint
from nnx_es.errors import CorruptCheckpointError, ResumeError
from nnx_es.lifecycle import compiled_table
from nnx_es.storage import BlobStore
from projections.commits import GroupTracker
from projections.view import Projections, committed, fold

__all__ = ["ResumePoint", "find_resume_point"]


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


def _read_whole(run_dir: Path, log: EventLog) -> list[tuple[int, Event]]:
    """Every event of ``log``; a log that breaks invariant 1 is refused, never continued.

    The keys are checked first, by themselves (``check_keys``: the chunked read derives
    seqs from chunk boundaries, and the checksums cover values only, so a changed key
    is seen by neither).
    """
    try:
        log.check_keys()
    except SequenceGapError as exc:
        raise ResumeError(f"cannot resume {run_dir}: its event log has a {exc}; nothing was restored or written") from exc
    try:
        events = list(log.read())
    except CorruptEventError as exc:
        raise ResumeError(f"cannot resume {run_dir}: {exc}; nothing was restored or written") from exc
    for first, last, problem, _, _ in log.verify_sums(len(events)):
        if problem != "uncovered":  # values of a log older than checksums are read unverified
            why = _SUM_PROBLEMS[problem]
            raise ResumeError(f"cannot resume {run_dir}: its event log's values seq {first}..{last} {why}; "
                              "nothing was restored or written")
    return events


_SUM_PROBLEMS = {
    "mismatch": "do not match their checksum (a byte changed on disk)",
    "missing": "were written together and some are missing",
    "stray": "are covered by no checksum record",
    "malformed": "have a malformed checksum record",
}


def find_resume_point(run_dir: Path, log: EventLog, *, expect_run_id: str | None = None,
                      at: int | str | None = None) -> ResumePoint:
    """Locate and verify the LAST commit of the run whose log is ``log``.

    ``at``: another committed LAST than the latest -- its seq, or ``"best"`` (the latest LAST
    naming BEST's manifest): where a new run forks from (the projections stay the latest's).

    Raises:
        ResumeError: the log's keys are not 0, 1, 2, ... (a gap, a duplicate or a key out
            of order) or a value does not decode (invariant 1: the seq is named), no LAST commit, or the LAST checkpoint
            is missing, empty, torn, corrupt or mixed (the reason is named).
        EventLogError: LMDB cannot read the log.
    """
    table = compiled_table()
    state = "new"
    run_id = expect_run_id
    last: tuple[int, LastCommitted] | None = None
    started: RunStarted | None = None
    boundary = -1
    group = GroupTracker()
    proj = Projections()
    events = _read_whole(run_dir, log)
    for seq, event in events:
        state = table.get((state, event.KIND), state)
        if isinstance(event, RunStarted):
            started = started or event
            if run_id is None:
                run_id = event.run_id
        if group.see(event.KIND):  # a LAST or its group: the committed prefix reaches here
            boundary = seq
        if event.KIND == "run_resumed":
            boundary = seq
    kept: set[int] = set()
    lasts: list[tuple[int, LastCommitted]] = []
    for seq, event in committed(events):
        if seq > boundary:
            break
        kept.add(seq)
        proj = fold(proj, seq, event)
        if isinstance(event, LastCommitted):
            last = (seq, event)
            lasts.append(last)
    if last is None:
        raise ResumeError(f"run at {run_dir} has no committed LAST checkpoint to resume from")
    if at is not None:
        last = _chosen_last(run_dir, lasts, at, proj)
    seq, event = last
    pruned = proj.checkpoints.pruned.get(event.manifest)
    if pruned is not None:
        raise ResumeError(
            f"LAST (seq {seq}, epoch {event.epoch}) is refused: checkpoint retention pruned it ({pruned}); "
            "start from a kept checkpoint (the latest LAST, or BEST), or train with keep_last=None to keep "
            "every one; nothing was restored"
        )
    store = BlobStore(Path(run_dir) / "blobs", log=log)
    try:
        manifest = verify_checkpoint(store, event.manifest, run_id=run_id)
    except CorruptCheckpointError as exc:
        raise ResumeError(
            f"LAST (seq {seq}, manifest {event.manifest}) is refused: {exc}; "
            "the run's history is kept, nothing was restored"
        ) from exc
    # the first event the committed view leaves out: after the boundary, or earlier when a
    # deferred LAST left the events between its ``covers`` and itself pending
    session = max((s for s, e in events if e.KIND == "run_resumed" and s <= boundary), default=-1)
    discard_from = next((s for s, _ in events if session < s <= boundary and s not in kept), boundary + 1)
    return ResumePoint(
        run_id=run_id or Path(run_dir).name,
        manifest_hash=event.manifest,
        manifest=manifest,
        last_seq=seq,
        discard_from=discard_from,
        discard_to=log.next_seq,
        state=state,
        projections=proj,
        started=started,
    )


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
    seqs = [s for s, _ in lasts]
    raise ResumeError(f"run at {run_dir} has no committed LAST at seq {at}; its committed LASTs are at {seqs}")

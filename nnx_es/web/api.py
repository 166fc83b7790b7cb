"""What each page of ``nnx-es serve`` shows, as JSON-ready builtins: built on the readers of ``tools/inspect``
and ``tools/replay``, never on a fold of its own.

| function | shows | built on |
|---|---|---|
| :func:`overview` | what the three below show, read once | :func:`nnx_es.cli.projected.summary_doc` (``inspect summary``), the run's ``run_started`` |
| :func:`runs` | every run: status, live or not, epochs, BEST, events, lineage | :func:`run_row` of each run's overview |
| :func:`run` | one run's summary, declaration and history records | its overview |
| :func:`epoch_curves` | the per-epoch curves | the history projection of its overview |
| :func:`update_curves` | the per-update curves, downsampled, read a bounded part at a time | :class:`nnx_es.web.curves.UpdateCurves` |
| :func:`events` | a page of events, filtered by kind and epoch | the log's chunks; rows as ``inspect`` prints them |
| :func:`event` | one event's fields and the commit that holds it | :func:`projections.committed` from :func:`nnx_es.audit.reading.restart_seq` |
| :func:`at` | every projection at a seq (time travel) | :func:`nnx_es.cli.projected.at_doc` (``inspect --at``) |
| :func:`audit` | the audit's verdict | :func:`nnx_es.audit.audit_run` (``tools/replay``) |
| :func:`diff` | where two runs first differ, both logs around it | :func:`nnx_es.cli.many.first_difference` (``inspect diff``) |
| :func:`rows` | the cartography data map | :func:`nnx_es.rows.read_rows`, :func:`nnx_es.rows.dynamics.cartography` |

Each takes the directories :meth:`nnx_es.web.reading.RunsRoot.reading` resolved (or a run's :class:`Overview`),
and opens the logs itself, read-only. Strings from a log are returned as they are: the page inserts them as text, never
as markup, and the JSON escapes a terminal's controls (:func:`nnx_es.cli._format.json_line`).
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np

from events.codec import KINDS, decode, decode_many
from events.errors import CorruptEventError, NnxError
from events.lmdbfile import MAX_SEQ
from events.log import LmdbLog
from events.paths import check_entry
from events.schema import Event, HistoryRecord, LastCommitted, RunResumed, RunStarted
from nnx_es.audit import INVARIANTS, audit_run, decoded, open_run_log
from nnx_es.audit.reading import restart_seq
from nnx_es.cli.listing import compact, event_epoch, event_json
from nnx_es.cli.many import first_difference
from nnx_es.cli.projected import at_doc, summary_doc
from nnx_es.web.curves import UpdateCurves, finite
from projections import Projections, committed
from projections.commits import CLOSING_KINDS, GROUP_KINDS
from projections.status import UNFINISHED

__all__ = ["CURVES", "MAX_LIMIT", "MAX_POINTS", "NoSuchEventError", "Overview", "SCAN_BUDGET", "at", "audit", "diff",
           "epoch_curves", "event", "events", "in_range", "log_identity", "overview", "rows", "run", "run_row", "runs",
           "unreadable_row", "update_curves"]

#: most events one page of :func:`events` holds
MAX_LIMIT = 1000
#: most events one call of :func:`events` reads looking for matches (a filter that matches few events of a
#: long log answers with the matches so far and where to go on: ``next``)
SCAN_BUDGET = 1 << 20
#: most rows the data map returns (a longer run's rows: an even sample, said in ``shown``)
MAX_POINTS = 20000
#: events shown on each side of where two runs first differ
DIFF_CONTEXT = 12
_INTEGER = re.compile(r"-?[0-9]{1,20}")


class NoSuchEventError(NnxError, LookupError):
    """The run's log holds no event at the seq asked for (its length named)."""


# --- the runs ----------------------------------------------------------------------------------------------


def _started(first: Event | None) -> str | None:
    t = getattr(first, "wall_time_s", None)
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t else None


def _lineage(first: Event | None) -> dict[str, Any]:
    """Where a run came from: ``source`` (a fork or continuation: run id, LAST seq, what it took) and
    ``init_from`` (a fine-tuning run's initial weights: kind, run id, checkpoint, epoch)."""
    if not isinstance(first, RunStarted):
        return {"source": None, "init_from": None}
    return {"source": msgspec.to_builtins(first.source), "init_from": msgspec.to_builtins(first.lineage)}


def _first(log: LmdbLog) -> Event | None:
    pair = next(iter(decoded(log, 0, 1)), None)
    return None if pair is None else pair[1]


class Overview(NamedTuple):
    """What the runs list, a run's page and its per-epoch curves show of a run, read once (:func:`overview`):
    ``run_id`` (its directory's name); ``doc``, its summary; ``projections``, the state ``doc`` was made
    from; ``first``, its first event."""

    run_id: str
    doc: dict[str, Any]
    projections: Projections
    first: Event | None


def overview(run_dir: Path) -> Overview:
    """The run's summary (what ``inspect summary --json`` prints: folded from its newest snapshot, O(events since
    it)) with ``damaged``, ``live``, ``started`` and ``lineage``, the projections it was made from, and its first
    event.

    Raises:
        NotARunError / EventLogError / UnsafePathError / SequenceGapError: the run cannot be read.
    """
    with open_run_log(run_dir) as log:
        doc, damaged, p = summary_doc(log, run_dir)
        first = _first(log)
    doc["damaged"] = damaged
    doc["live"] = doc["status"] in UNFINISHED and bool(doc["writer_alive"])
    doc["started"] = _started(first)
    doc["lineage"] = _lineage(first)
    return Overview(run_dir.name, doc, p, first)


def run_row(ov: Overview) -> dict[str, Any]:
    """One run of :func:`runs`: ``run_id`` (the directory's name), ``status``, ``writer_alive`` (for a run
    not finalized: a process on this machine holds its writer lease; False: killed or crashed?), ``live``,
    ``epochs``, ``best`` (BEST's pointer: epoch, step, value), ``events``, ``tail``, ``started`` (UTC),
    ``damaged`` (values read do not verify), ``lineage``."""
    doc = ov.doc
    return {"run_id": ov.run_id, **{k: doc[k] for k in (
        "status", "writer_alive", "live", "epochs", "last_epoch", "best", "events", "tail", "started", "damaged",
        "lineage", "error_type", "error", "stop_reason")}}


def unreadable_row(run_id: str, exc: BaseException) -> dict[str, Any]:
    """The row of a run that cannot be read: status ``unreadable``, the error's type and message."""
    return {"run_id": run_id, "status": "unreadable", "error_type": type(exc).__name__, "error": str(exc),
            "live": False, "lineage": {"source": None, "init_from": None}}


def runs(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs list: ``rows`` (each :func:`run_row` or :func:`unreadable_row`) with each run's
    ``children`` (the runs of the list whose lineage names it) and whether any run is ``live``."""
    children: dict[str, list[str]] = {}
    for row in rows:
        for ref in row["lineage"].values():
            if ref and ref.get("run_id"):
                children.setdefault(ref["run_id"], []).append(row["run_id"])
    for row in rows:
        row["children"] = sorted(children.get(row["run_id"], []))
    return {"runs": rows, "live": any(r["live"] for r in rows)}


def run(ov: Overview) -> dict[str, Any]:
    """One run: its summary (what ``inspect summary --json`` prints) with ``live``, ``started``,
    ``lineage``; ``declared`` (from ``run_started``: seed, optimizers, schedulers, monitor, callbacks,
    accumulation, world size); ``history`` (the history projection's records)."""
    first, declared = ov.first, {}
    if isinstance(first, RunStarted):
        declared = {"seed": first.seed, "optimizers": first.optimizers, "callbacks": first.callbacks,
                    "schedulers": msgspec.to_builtins(first.schedulers), "monitor": msgspec.to_builtins(first.monitor),
                    "accumulation": first.accumulation, "world_size": first.world_size,
                    "from_spec": first.spec is not None}
    return {**ov.doc, "run_id": ov.doc["run_id"] or ov.run_id, "declared": declared,
            "history": msgspec.to_builtins(ov.projections.history.records)}


# --- curves --------------------------------------------------------------------------------------------------


CURVES = ("epoch", "update")


def epoch_curves(ov: Overview) -> dict[str, Any]:
    """The run's per-epoch curves, from the history projection of its committed view: ``x`` (0-based epochs)
    and one list per series -- ``train/<key>`` and ``val/<key>`` of each history record (losses, loss terms,
    metrics), ``monitor``, ``lr/<optimizer>/<group>`` -- aligned on ``x`` (``None`` where a record has no such
    value, or a value that is not finite); ``improved``: the monitor's decision of each."""
    return _epoch_series(ov.projections.history.records)


def log_identity(run_dir: Path) -> tuple[Any, ...]:
    """What tells one log from another at the same path: its path, the device and inode of its data file, and
    the bytes of its first event (a run deleted and written again under the same id may get the same inode;
    its ``run_started`` holds its start time).

    Raises:
        NotARunError / UnsafePathError / EventLogError: as :func:`nnx_es.audit.open_run_log`.
    """
    with open_run_log(run_dir) as log:
        st = check_entry(run_dir / "events.lmdb" / "data.mdb", "file")
        first = next(iter(log.read_raw(0, 1)), None)
    return (str(run_dir), st and st.st_dev, st and st.st_ino, None if first is None else bytes(first[1]))


def update_curves(run_dir: Path, curves: UpdateCurves, budget: int) -> dict[str, Any]:
    """The run's per-update curves: ``curves`` (this run's :class:`~nnx_es.web.curves.UpdateCurves`, kept
    between requests) read up to ``budget`` more events of its log, then what it holds
    (:meth:`~nnx_es.web.curves.UpdateCurves.doc`: per optimizer ``loss/<opt>``, ``grad_norm/<opt>`` when
    computed and ``lr/<opt>`` (its first group's rate), each ``{"x": steps, "y": values, "updates": n}``, a min
    and a max per bucket of ``steps_per_bucket`` steps; how much of the log is read: ``parts_read`` of
    ``parts``, ``read``, ``complete``).

    Raises:
        WriterAppearedError: a writer opened the log during a read (what it read is not kept: read again).
    """
    with open_run_log(run_dir) as log:
        curves.read(log, budget)
    return curves.doc()


def _epoch_series(history: tuple[HistoryRecord, ...]) -> dict[str, Any]:
    series: dict[str, list[float | None]] = {}
    for part in ("train", "val"):
        for key in sorted({k for r in history for k in getattr(r, part)}):
            series[f"{part}/{key}"] = finite(getattr(r, part).get(key, math.nan) for r in history)
    if any(r.monitor_value is not None for r in history):
        series["monitor"] = finite(r.monitor_value for r in history)
    for opt in sorted({o for r in history for o in r.lrs}):
        for g in range(max(len(r.lrs.get(opt, [])) for r in history)):
            series[f"lr/{opt}/{g}"] = finite(r.lrs[opt][g] if g < len(r.lrs.get(opt, [])) else None for r in history)
    return {"x": [r.epoch for r in history], "series": series, "improved": [bool(r.improved) for r in history]}


# --- events --------------------------------------------------------------------------------------------------


def in_range(name: str, value: int | str | None, lo: int, hi: int, default: int | None = None) -> int:
    """The integer parameter ``name`` (an int, or the text of a query parameter) checked to lie in ``lo..hi``;
    ``default`` when it is missing (None or empty text). Every integer parameter of the API is read here, so a
    bad one is always said the same way.

    Raises:
        ValueError: ``"<name>: expected an integer in <lo>..<hi>, got <value>"`` -- not an integer (text that
            is not an optional minus and digits), out of range, or missing without a default.
    """
    if value is None or value == "":
        if default is None:
            raise ValueError(f"{name}: expected an integer in {lo}..{hi}, got nothing")
        return default
    n = value if type(value) is int else int(value) if isinstance(value, str) and _INTEGER.fullmatch(value) else None
    if n is None or not lo <= n <= hi:
        raise ValueError(f"{name}: expected an integer in {lo}..{hi}, got {value!r}")
    return n


def parse_kinds(text: str | None) -> frozenset[str] | None:
    """``"a,b"`` -> the kinds named (None: every kind).

    Raises:
        ValueError: a kind that is not one (the known ones named).
    """
    wanted = {k.strip() for k in (text or "").split(",") if k.strip()}
    unknown = sorted(wanted - set(KINDS))
    if unknown:
        raise ValueError(f"kind: unknown kind(s) {', '.join(unknown)}; known kinds: {', '.join(KINDS)}")
    return frozenset(wanted) or None


def parse_epochs(text: str | None) -> tuple[int, int] | None:
    """``"A"`` or ``"A:B"`` (0-based, inclusive) -> ``(A, B)`` (None: every epoch).

    Raises:
        ValueError: not that form, or ``B < A``.
    """
    if not text:
        return None
    a, sep, b = text.partition(":")
    try:
        lo, hi = int(a), int(b) if sep else int(a)
    except ValueError:
        raise ValueError(f"epoch: expected EPOCH or FIRST:LAST (0-based), got {text!r}") from None
    if lo < 0 or hi < lo:
        raise ValueError(f"epoch: expected 0 <= FIRST <= LAST, got {text!r}")
    return lo, hi


def _row(seq: int, event: Event) -> dict[str, Any]:
    return {"seq": seq, "kind": event.KIND, "epoch": event_epoch(event), "fields": compact(event)}


def _pairs(log: LmdbLog, start: int, stop: int) -> Iterator[tuple[int, Event | CorruptEventError]]:
    """``(seq, event)`` of ``[start, stop)`` in stored order; a value that does not decode as its error."""
    for first, values in log.read_chunks(start, stop):
        try:
            yield from zip(itertools.count(first), decode_many(values, first))
        except CorruptEventError:
            for seq, raw in enumerate(values, first):
                try:
                    yield seq, decode(raw, seq)
                except CorruptEventError as exc:
                    yield seq, exc


def events(run_dir: Path, *, start: int = 0, limit: int = 100, kinds: frozenset[str] | None = None,
           epochs: tuple[int, int] | None = None, budget: int = SCAN_BUDGET) -> dict[str, Any]:
    """A page of the run's events from seq ``start`` on: at most ``limit`` rows of the kinds and epochs asked
    (each ``seq``, ``kind``, ``epoch``, ``fields`` as ``inspect`` prints them; a value that does not decode:
    ``kind`` None and its ``error``), reading at most ``budget`` events.

    ``next``: the seq to ask for the next page from (None: the log's end was reached); ``scanned_to``: the
    last seq read; ``total``: the log's length. Any page reads from its seq on by key (O(page), not
    O(seq)); a filter that matches few events of a long log reads up to ``budget`` and says where to go on.

    Raises:
        ValueError: ``limit`` not in 1..:data:`MAX_LIMIT`, or ``start`` not a seq (:func:`in_range`).
    """
    limit, start = in_range("limit", limit, 1, MAX_LIMIT), in_range("from", start, 0, MAX_SEQ - 1)
    with open_run_log(run_dir) as log:
        total = log.next_seq
        found: list[dict[str, Any]] = []
        read, seq = 0, start - 1
        next_seq: int | None = None
        for seq, event in _pairs(log, start, total):
            read += 1
            if isinstance(event, CorruptEventError):
                if kinds is None and epochs is None:
                    found.append({"seq": seq, "kind": None, "epoch": None, "error": event.reason})
            elif (kinds is None or event.KIND in kinds) and (
                    epochs is None or (e := event_epoch(event)) is not None and epochs[0] <= e <= epochs[1]):
                found.append(_row(seq, event))
            if len(found) == limit or read >= budget:
                next_seq = seq + 1 if seq + 1 < total else None
                break
    return {"events": found, "from": start, "next": next_seq, "scanned_to": seq, "total": total,
            "kinds": list(KINDS)}


def _commit_of(log: LmdbLog, seq: int, kind: str) -> dict[str, Any]:
    """Which commit makes event ``seq`` durable, read forward from a point where the committed view can
    restart (:func:`nnx_es.audit.reading.restart_seq`) until it yields it (:func:`projections.committed`).

    ``state``: ``committed`` (``by``: the LAST that commits it, or ``None`` for a resume, synced when
    written), ``closing`` (how a finalized run ended: folded from its tail), ``discarded`` (a resume
    dropped it: ``by`` is that ``run_resumed``) or ``uncommitted`` (the tail after the last commit).
    """
    if kind == "run_resumed":
        return {"state": "committed", "by": None, "why": "a resume is synced when written: it commits itself"}
    start = restart_seq(log, seq + 1)
    yielded_at = False
    last: tuple[int, LastCommitted] | None = None
    for s, e in committed(decoded(log, start)):
        if type(e) is LastCommitted:
            if s == seq or yielded_at:
                return {"state": "committed", "by": _last(log, s, e)}
            last = (s, e)
        elif type(e) is RunResumed and s > seq:
            if e.discard_from <= seq < e.discard_to:
                return {"state": "discarded", "by": _row(s, e), "why": "the resume after it dropped it"}
        if s == seq:
            if kind in GROUP_KINDS and last is not None and _in_group(log, last[0], seq):
                return {"state": "committed", "by": _last(log, *last)}
            yielded_at = True
    if yielded_at and kind in CLOSING_KINDS:
        return {"state": "closing", "by": None,
                "why": "the run was finalized: how it ended is folded from the tail after its last commit"}
    return {"state": "uncommitted", "by": None, "why": "after the last commit: readers ignore it"}


def _in_group(log: LmdbLog, last_seq: int, seq: int) -> bool:
    return all(e.KIND in GROUP_KINDS for _, e in decoded(log, last_seq + 1, seq + 1))


def _last(log: LmdbLog, s: int, e: LastCommitted) -> dict[str, Any]:
    """A LAST and its commit group (the events of :data:`projections.commits.GROUP_KINDS` right after it)."""
    group = []
    for gs, ge in decoded(log, s + 1):
        if ge.KIND not in GROUP_KINDS:
            break
        group.append(_row(gs, ge))
    return {**_row(s, e), "covers": e.covers, "group": group}


def event(run_dir: Path, seq: int) -> dict[str, Any]:
    """Event ``seq`` with every field (``event``: as ``inspect --json`` prints it), the commit that holds it
    (``commit``: :func:`_commit_of`) and its neighbours' seqs (``previous``, ``next``; None at an end).

    Raises:
        NoSuchEventError: no event ``seq`` (the log's length named).
        CorruptEventError: its value does not decode.
    """
    with open_run_log(run_dir) as log:
        total = log.next_seq
        pair = next(iter(log.read_raw(seq, seq + 1)), None) if 0 <= seq < total else None
        if pair is None or pair[0] != seq:
            raise NoSuchEventError(f"no event {seq} in {run_dir.name}: its log holds seqs 0..{total - 1}")
        e = decode(pair[1], seq)
        commit = _commit_of(log, seq, e.KIND)
    return {"event": event_json(seq, e), "epoch": event_epoch(e), "commit": commit,
            "previous": seq - 1 if seq > 0 else None, "next": seq + 1 if seq + 1 < total else None, "total": total}


# --- time travel, audit, diff, rows ----------------------------------------------------------------------------


def at(run_dir: Path, seq: int) -> dict[str, Any]:
    """Every projection after the log up to ``seq``: what ``inspect RUN --at SEQ --json`` prints
    (:func:`nnx_es.cli.projected.at_doc`), with the event at ``seq`` (``event``: its row) and the log's
    length (``total``)."""
    with open_run_log(run_dir) as log:
        doc = at_doc(log, seq)
        total = log.next_seq
        pair = next(iter(_pairs(log, seq, seq + 1)), None) if seq < total else None
    shown = None
    if pair is not None:
        shown = _row(*pair) if not isinstance(pair[1], CorruptEventError) else {"seq": pair[0], "kind": None}
    return {**doc, "event": shown, "total": total}


def audit(run_dir: Path) -> dict[str, Any]:
    """``tools/replay``'s verdict (:func:`nnx_es.audit.audit_run`): ``ok``, ``violations`` (each ``seq``,
    ``invariant``, ``message``, ``expected``, ``found``), ``notes``, and ``invariants`` (number -> what it
    demands)."""
    report = audit_run(run_dir)
    return {**msgspec.to_builtins(report), "invariants": {str(k): v for k, v in INVARIANTS.items()}}


def _around(log: LmdbLog, seq: int) -> list[dict[str, Any]]:
    lo = max(0, seq - DIFF_CONTEXT)
    return [_row(s, e) if not isinstance(e, CorruptEventError) else {"seq": s, "kind": None}
            for s, e in _pairs(log, lo, min(seq + DIFF_CONTEXT + 1, log.next_seq))]


def diff(a: Path, b: Path) -> dict[str, Any]:
    """Where runs ``a`` and ``b`` first differ (``first_difference``: what ``inspect diff --json`` prints:
    ``seq``, ``kind_a``, ``kind_b``, ``field``, ``a``, ``b``; None: the same events), and each log's events
    around it (``a_events``, ``b_events``: :data:`DIFF_CONTEXT` on each side).

    Raises:
        DamagedLogError / CorruptEventError / EventLogError / UnsafePathError: as
            :func:`nnx_es.cli.many.first_difference` (damage is never said as a difference).
    """
    found = first_difference(a, b)
    out: dict[str, Any] = {"a": a.name, "b": b.name, "same": found is None, "first_difference": found}
    if found is not None:
        for name, run_dir in (("a_events", a), ("b_events", b)):
            with open_run_log(run_dir) as log:
                out[name] = _around(log, found["seq"])
    return out


def rows(run_dir: Path) -> dict[str, Any]:
    """The data map of the run's committed per-row training records (Swayamdipta et al. 2020, Figure 1):
    each row's ``variability``, ``confidence`` and ``correctness`` across the committed epochs
    (:mod:`nnx_es.rows.dynamics`), hardest first, as columns; ``rows``: how many the run has, ``shown``:
    how many are returned (at most :data:`MAX_POINTS`, an even sample of the order when more).
    ``rows`` 0: the run recorded none (its batches carried no row ids: ``nnx_es.rows.with_row_ids``).

    Raises:
        CorruptCheckpointError: a committed journal chunk or manifest does not verify.
    """
    from nnx_es.rows.dynamics import cartography
    from nnx_es.rows.reader import read_rows

    state = cartography(read_rows(run_dir))
    n = int(state.row_id.size)
    order = state.hardest(n)
    if n > MAX_POINTS:
        order = order[np.linspace(0, n - 1, MAX_POINTS).astype(np.int64)]
    c = state.columns()
    return {"rows": n, "shown": int(order.size), "epochs": int(state.epochs.max()) if n else 0,
            "columns": {name: c[name][order].tolist() for name in
                        ("row_id", "epochs", "confidence", "variability", "correctness")}}

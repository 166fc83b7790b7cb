"""``inspect RUN_DIR --at SEQ`` and ``inspect RUN_DIR summary``: a run's projected state, read-only.

Both fold the log's committed view up to a seq from its newest usable projection snapshot
(:func:`nnx_es.audit.project_log`: O(events since that snapshot)), and print it as text or
one JSON object (a snapshot skipped as unusable is said on stderr); the summary adds what a person asks of a run first (is it
finished, is its writer alive, do its values verify).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from events.log import LmdbLog
from nnx_es.audit import committed_tail, project_log
from nnx_es.cli._common import reader_left, writer_alive
from nnx_es.cli._format import fmt, json_line, printable
from nnx_es.views import summary as summary_of
from projections import Projections
from projections.status import UNFINISHED

__all__ = ["Summary", "at", "at_doc", "projected", "summary", "summary_doc"]


def projected(log: LmdbLog, stop: int, *, check_keys: bool = False) -> tuple[Projections, int, int]:
    """The projections of the events in ``[0, stop)``, their uncommitted tail, and the seq the fold
    started at (0, or the snapshot's seq + 1).

    From the newest usable snapshot below ``stop`` on, a chunk at a time, decoding the
    frequent kinds partially, as the runtime projects (:func:`nnx_es.audit.project_log`); a
    log holding a value that does not decode there is projected again without it. The tail
    is read back from the end (:func:`nnx_es.audit.committed_tail`, about one epoch).
    ``check_keys``: check the keys of the events folded (the snapshot's seq + 1 to ``stop``).

    Raises:
        SequenceGapError: ``check_keys`` and a key folded is out of place.
    """
    p, start, notes = project_log(log, stop, skip_undecodable=True)
    if check_keys:
        log.check_keys(start, stop)
    for note in notes:
        print(printable(f"inspect: {note}"), file=sys.stderr)
    return p, committed_tail(log, stop), start


def at_doc(log: LmdbLog, seq: int) -> dict[str, Any]:
    """Every projection after folding the committed view of the log up to ``seq`` (time travel), as the
    JSON-ready object ``inspect --at SEQ --json`` prints: ``at``, ``past_end``, ``events`` (read),
    ``tail`` (uncommitted), ``checkpoint`` (LAST then) and ``projections``. A ``seq`` past the log's end
    answers for the whole log (``past_end``: the state then is the end's, not one the run was in at ``seq``).

    Raises:
        SequenceGapError: a key folded (from the snapshot on, up to ``seq``) is out of place.
    """
    return _at(log, seq)[0]


def _at(log: LmdbLog, seq: int) -> tuple[dict[str, Any], Projections]:
    stop = min(seq + 1, log.next_seq)
    p, tail, _ = projected(log, stop, check_keys=True)
    last = p.checkpoints.last
    return {
        "at": seq,
        "past_end": seq >= log.next_seq,
        "events": stop,
        "tail": tail,
        "checkpoint": None if last is None else msgspec.to_builtins(last),
        "projections": msgspec.to_builtins(p),
    }, p


def at(log: LmdbLog, seq: int, as_json: bool) -> None:
    """Print :func:`at_doc` (one JSON object, or text); a ``seq`` past the log's end is also said on stderr."""
    if seq >= log.next_seq:
        sys.stderr.write(f"inspect: seq {seq} is past the log's end (its last event is seq {log.next_seq - 1}): "
                         "answering for the whole log\n")
    doc, p = _at(log, seq)
    stop, past_end, tail = doc["events"], doc["past_end"], doc["tail"]
    last = p.checkpoints.last
    if as_json:
        sys.stdout.write(json_line(doc) + "\n")
        return
    where = "no committed checkpoint yet" if last is None else f"LAST epoch {last.epoch} step {last.step} manifest {last.manifest}"
    past = f" (past the end: the log's last event is seq {stop - 1})" if past_end else ""
    lines = [f"at seq {seq}{past}: {stop} events read, {tail} uncommitted; corresponds to {where}"]
    lines += [f"{name:<12} {fmt(getattr(p, name))}" for name in ("status", "counters", "checkpoints", "schedulers")]
    lines += [f"{'history':<12} epoch {r.epoch}: {fmt(r.train)} {fmt(r.val)} improved={fmt(r.improved)}"
              for r in p.history.records]
    sys.stdout.write("".join(printable(line) + "\n" for line in lines))


def summary(log: LmdbLog, run_dir: Path, as_json: bool, *, verify: bool = False) -> bool:
    """The summary of a run, from its newest usable snapshot: O(events since it), not O(run); returns
    whether every value it verified verifies (False: the exit status says damage, as ``tools/replay``'s).

    It verifies what it folds: the snapshot's own checksum (an unusable snapshot is skipped with
    a note on stderr), then the keys of the events after it and the checksums of the values
    after it (of the write batch holding the snapshot's seq on); ``verified`` says from which
    seq. Damage *before* the snapshot is not seen here (the snapshot was folded from those
    values while intact): ``verify`` checks the whole log (every key -- the caller,
    :func:`nnx_es.cli.inspect._run`, checks them first -- and every value's checksum), and
    ``tools/replay`` audits every invariant from seq 0. The issue 14 contract: opening a run
    costs O(events since the nearest snapshot).

    Raises:
        SequenceGapError: a key after the snapshot is out of place.
    """
    doc, damaged, _ = summary_doc(log, run_dir, verify=verify)
    # a run of the nnx-es CLI (its run_started holds a spec) resumes with nnx-es resume; one event read
    first = next(iter(log.read(0, 1)), None) if doc["writer_alive"] is False else None
    from_cli = first is not None and getattr(first[1], "spec", None) is not None
    try:
        _print_summary(doc, run_dir, as_json, from_cli=from_cli)
        sys.stdout.flush()  # here: a closed pipe is met now, not above the verdict
    except BrokenPipeError:  # the reader left early (`| head`): the verdict is returned all the same
        reader_left()
    return not damaged


class Summary(NamedTuple):
    """What :func:`summary_doc` returns: ``doc``, the JSON-ready object ``inspect summary --json`` prints;
    ``damaged``: values it verified do not verify; ``projections``: the state ``doc`` was made from."""

    doc: dict[str, Any]
    damaged: bool
    projections: Projections


def summary_doc(log: LmdbLog, run_dir: Path, *, verify: bool = False) -> Summary:
    """What :func:`summary` says of a run (:class:`Summary`), read and verified as :func:`summary` says.

    Raises:
        SequenceGapError: a key after the snapshot is out of place.
    """
    alive = writer_alive(run_dir)  # before the log: a writer that finalizes meanwhile is not taken for dead
    stop = log.next_seq
    p, tail, start = projected(log, stop, check_keys=not verify)
    start = 0 if verify else start
    checksums, damaged = _checksums(log, stop, start)
    doc = {**summary_of(p), "events": stop, "tail": tail, "writer_alive": None,
           "checksums": checksums, "verified": _verified(start, run_dir)}
    if stop and p.status.status in UNFINISHED:  # asked again: a writer resuming it meanwhile counts as alive
        doc["writer_alive"] = alive or writer_alive(run_dir)
    if p.history.records:
        doc["lrs"] = {opt: list(lrs) for opt, lrs in p.history.records[-1].lrs.items()}
    return Summary(doc, damaged, p)


def _print_summary(doc: dict[str, Any], run_dir: Path, as_json: bool, *, from_cli: bool = False) -> None:
    if as_json:
        sys.stdout.write(json_line(doc) + "\n")
        return
    lines = [(printable(k), printable(v)) for k, v in _summary_lines(doc, run_dir, from_cli=from_cli)]
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(show_header=False, box=None, pad_edge=False)
        table.add_column(style="bold")
        table.add_column()
        for key, value in lines:
            table.add_row(Text(key), Text(value))  # Text: a "[bold]" in a run's strings is shown, not markup
        Console(highlight=False).print(table)
    else:
        width = max(len(k) for k, _ in lines)
        sys.stdout.write("".join(f"{k:<{width}}  {v}\n" for k, v in lines))


def _verified(start: int, run_dir: Path) -> dict[str, Any]:
    """What the summary verified: keys and checksums from ``from_seq`` on (0: the whole log), after
    the snapshot at ``snapshot_seq`` (None: none used), and how to verify everything."""
    return {"from_seq": start, "snapshot_seq": start - 1 if start else None,
            "whole_log": f"tools/replay {run_dir}" if start == 0 else
            f"tools/replay {run_dir} (every invariant) or inspect {run_dir} summary --verify"}


def _checksums(log: LmdbLog, stop: int, start: int = 0) -> tuple[str, bool]:
    """Whether the stored values from ``start`` on verify against their CRC-32s (:mod:`events.sums`; from
    the write batch holding ``start``): the one check of the log's bytes ``summary`` makes (a streamed
    pass, ~0.2 s a million events); ``tools/replay`` names what differs. Returns what to print and
    whether a range does not verify."""
    bad, uncovered = 0, 0
    for first, last, problem, _, _ in log.verify_sums(stop, start=start):
        if problem == "uncovered":
            uncovered += last - first + 1
        else:
            bad += 1
    if bad:
        return f"{bad} range{'s' if bad != 1 else ''} of values do not verify: run tools/replay", True
    if uncovered and uncovered >= stop - start:
        return "not verified: the log was written before checksums existed", False
    return "ok" + (f" ({uncovered} values written before checksums existed are not covered)" if uncovered else ""), False


def _pointer(ptr: dict[str, Any] | None) -> str:
    if ptr is None:
        return "-"
    value = "" if ptr.get("value") is None else f"  value={fmt(ptr['value'])}"
    return f"epoch {ptr['epoch']}  step {ptr['step']}  manifest {ptr['manifest'][:12]}{value}"


def _summary_lines(doc: dict[str, Any], run_dir: Path, *, from_cli: bool = False) -> list[tuple[str, str]]:
    """The summary's (label, value) lines; ``from_cli``: the run was started by ``nnx-es run`` (its
    ``run_started`` holds a spec), so a killed one is resumed with ``nnx-es resume``, not ``fit``."""
    status = doc["status"]
    if doc.get("stop_reason"):
        status += f" (stop: {doc['stop_reason']})"
    if doc.get("error_type"):
        status += f" ({doc['error_type']}: {doc['error']})"
    if doc.get("writer_alive") is False:
        status += " (no process on this machine is writing it: killed or crashed? " + (
            (f"resume it with nnx-es resume {str(run_dir.resolve())!r})" if from_cli else
             f"resume it with fit(..., resume_from={str(run_dir.resolve())!r}))") if doc["last"] is not None
            else "it has no checkpoint to resume from)")
    lines = [
        ("run", f"{doc['run_id'] or run_dir.name}  ({run_dir})"),
        ("status", status),
        ("epochs", f"{doc['epochs']} committed" + (f", last epoch {doc['last_epoch']}" if doc["epochs"] else "")),
        ("LAST", _pointer(doc["last"])),
        ("BEST", _pointer(doc["best"])),
    ]
    for name, ptr in sorted(doc["phases"].items()):
        lines.append((f"phase {name}", _pointer(ptr)))
    for opt, lrs in sorted(doc.get("lrs", {}).items()):
        lines.append((f"lr {opt}", fmt(lrs)))
    for name, s in sorted(doc["schedulers"].items()):
        plateau = "" if s["plateau"] is None else f"  plateau {fmt(s['plateau'])}"
        lines.append((f"scheduler {name}", f"{s['clock']}  steps {s['steps']}  lrs {fmt(s['lrs'])}{plateau}"))
    lines.append(("counters", " ".join(f"{k}={v}" for k, v in doc["counters"].items())))
    if doc.get("resumes"):
        lines.append(("resumes", str(doc["resumes"])))
    lines.append(("events", str(doc["events"])))
    lines.append(("checksums", doc["checksums"]))
    v = doc["verified"]
    lines.append(("verified", "the whole log: every key and every value's checksum" if v["from_seq"] == 0 else
                  f"from seq {v['from_seq']} on (the snapshot at seq {v['snapshot_seq']} by its own checksum); "
                  f"the whole log: {v['whole_log']}"))
    lines.append(("tail", f"{doc['tail']} uncommitted event{'s' if doc['tail'] != 1 else ''}"))
    return lines

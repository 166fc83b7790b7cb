"""What an audit returns: violations of the eleven invariants of docs/INVARIANTS.md, and the error for unusable input."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from events.errors import NnxError

__all__ = ["INVARIANTS", "AuditReport", "NotARunError", "Sink", "Violation", "show"]

#: Invariant number -> one line of what it demands (docs/INVARIANTS.md).
INVARIANTS: dict[int, str] = {
    1: "sequence numbers are contiguous from 0, every value decodes and matches its checksum",
    2: "the event sequence is a path through the lifecycle machine",
    3: "commit order per epoch: history -> LAST -> BEST/phase -> callback checkpoints",
    4: "every manifest LAST/BEST/phase (or an evaluation, an export) names, every callback blob, and each path's "
       "latest exported artifact still there, exists and verifies",
    5: "the uncommitted tail changes no projection",
    6: "each scheduler steps exactly once per tick of its clock",
    7: "one monitor decision per epoch; BEST, plateau and early stopping agree with it",
    8: "finalization in reverse callback order, for every begun callback; LAST refreshed after it",
    9: "materialized views equal the projections",
    10: "counters and scheduler state in LAST's checkpoint equal the projections",
    11: "the ranks of a data-parallel run agree on every recorded parameter digest; an elastic run's world "
        "changes keep its global batch",
}


class NotARunError(NnxError, FileNotFoundError):
    """The directory given to the audit or a tool does not exist or holds no ``events.lmdb`` log."""


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    """One broken invariant.

    seq: the 0-based sequence number of the event at fault (``None`` when the
    violation is about a file or the log as a whole). invariant: 1-11 (docs/INVARIANTS.md).
    expected / found: short renderings of what should be and what is, when meaningful.
    """

    seq: int | None
    invariant: int
    message: str
    expected: str | None = None
    found: str | None = None

    def line(self) -> str:
        """``seq N  invariant K  message (expected X, found Y)``."""
        where = f"seq {self.seq}" if self.seq is not None else "seq -"
        detail = []
        if self.expected is not None:
            detail.append(f"expected {self.expected}")
        if self.found is not None:
            detail.append(f"found {self.found}")
        tail = f" ({', '.join(detail)})" if detail else ""
        return f"{where}  invariant {self.invariant}  {self.message}{tail}"


class AuditReport(msgspec.Struct, kw_only=True):
    """The outcome of :func:`nnx_es.audit.audit_run`.

    events: values stored in the log (decodable or not). committed_epoch: the
    0-based epoch LAST names (``None`` when no epoch is committed). tail: events
    after the committed view that readers ignore. ok: no violation. notes: what
    the audit could not check and is not a violation (values of a log written
    before checksums existed).
    """

    ok: bool
    run_id: str
    status: str
    events: int
    committed_epoch: int | None
    tail: int
    violations: list[Violation]
    notes: list[str] = msgspec.field(default_factory=list)


def show(value: Any, limit: int = 200) -> str:
    """A short, stable rendering of ``value`` for ``expected`` / ``found``."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, float):
        text = repr(value)
    else:
        try:  # json keeps NaN / Infinity visible (msgspec.json would write null)
            text = json.dumps(msgspec.to_builtins(value), separators=(",", ":"))
        except (TypeError, ValueError, msgspec.EncodeError):
            text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Sink:
    """Collects violations from every check, and notes: what a check left unchecked on purpose (not a violation)."""

    __slots__ = ("notes", "violations")

    def __init__(self) -> None:
        self.violations: list[Violation] = []
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        """Say ``text`` in the report's notes."""
        self.notes.append(text)

    def add(self, seq: int | None, invariant: int, message: str, expected: Any = None, found: Any = None) -> None:
        self.violations.append(
            Violation(
                seq=seq,
                invariant=invariant,
                message=message,
                expected=None if expected is None else show(expected),
                found=None if found is None else show(found),
            )
        )

    def sorted(self) -> list[Violation]:
        """Violations by seq (log-wide ones last), then invariant, keeping discovery order otherwise."""
        return sorted(self.violations, key=lambda v: (v.seq is None, v.seq or 0, v.invariant))

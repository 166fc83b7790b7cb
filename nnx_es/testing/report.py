"""What a crash test or a fault test returns: plain values, printed readably.

``assert report.ok, report`` fails with the whole report as its message;
:meth:`Report.raise_for_failures` raises :class:`HarnessFailure` with the same text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nnx_es.errors import NnxError

__all__ = ["CrashReport", "Failure", "FaultReport", "HarnessFailure", "PowerLossReport", "Report"]


class HarnessFailure(NnxError, AssertionError):
    """A crash or fault test found points where the run does not hold (the report is the message)."""


@dataclass(frozen=True)
class Failure:
    """One point where a promise did not hold.

    point: the point as the runtime counts it (``event:57``, ``io:12:before``, ``sync:3:after``;
    an ``NNX_ES_KILL_AT`` value). where: what happens there in the reference run (the event's
    seq and kind, or the persistence step and the event it follows). check: the promise that
    failed. expected / found: what the reference says and what this run has. divergence: the
    first difference in training (the first step whose receipt differs, the first tensor of
    the final checkpoint that differs), when the run got that far.
    """

    point: str
    where: str
    check: str
    expected: str
    found: str
    divergence: str | None = None

    def __str__(self) -> str:
        lines = [f"{self.point} -- {self.where}", f"    {self.check}", f"      expected: {self.expected}",
                 f"      found:    {self.found}"]
        if self.divergence:
            lines += ["      first divergence:"] + [f"        {line}" for line in self.divergence.splitlines()]
        return "\n".join(lines)


@dataclass(frozen=True, repr=False)
class Report:
    """The points tried and what happened at each.

    tried: the points, in run order. outcomes: point -> ``"resumed"`` (the run resumed to the
    reference's final state), ``"refused"`` (nothing was committed yet: the resume was
    refused, as it must be) or ``"failed"``. failures: one entry per failed point (the first
    promise it broke). available: how many points the reference run has in all.
    elapsed_s: wall-clock seconds of the whole test, the reference run included.
    """

    epochs: int
    available: int
    tried: tuple[str, ...]
    outcomes: dict[str, str]
    failures: tuple[Failure, ...]
    elapsed_s: float
    title: str = field(default="crash test", init=False)

    @property
    def ok(self) -> bool:
        return not self.failures and len(self.outcomes) == len(self.tried)

    def __str__(self) -> str:
        resumed = sum(1 for v in self.outcomes.values() if v == "resumed")
        refused = sum(1 for v in self.outcomes.values() if v == "refused")
        head = (f"{self.title}: {'ok' if self.ok else 'FAILED'} -- {len(self.tried)} of {self.available} points "
                f"over {self.epochs} epoch(s) in {self.elapsed_s:.1f} s: {resumed} resumed bitwise, "
                f"{refused} refused (nothing committed yet), {len(self.failures)} failed")
        if not self.failures:
            return head
        return "\n".join([head, *(str(f) for f in self.failures)])

    def __repr__(self) -> str:  # pytest prints an assertion's message object with repr()
        return str(self)

    def raise_for_failures(self) -> None:
        """Raise :class:`HarnessFailure` (the report as its message) unless :attr:`ok`."""
        if not self.ok:
            raise HarnessFailure(str(self))


@dataclass(frozen=True, repr=False)
class CrashReport(Report):
    """A :class:`Report` of :func:`nnx_es.testing.crash_test` (SIGKILL at each point)."""

    title: str = field(default="crash test", init=False)


@dataclass(frozen=True, repr=False)
class FaultReport(Report):
    """A :class:`Report` of :func:`nnx_es.testing.fault_test`; ``tried`` holds ``<errno name> <point>``."""

    title: str = field(default="fault test", init=False)


@dataclass(frozen=True, repr=False)
class PowerLossReport(Report):
    """A :class:`Report` of :func:`nnx_es.testing.power_loss_test`: ``tried`` names the crash states
    checked (``state <p>.<digest>``: a state after persistence point p, by its content); ``available``
    counts the persistence points of the traced run (plus its start); ``points_with_states``
    how many of them got at least one state. Failures are printed grouped by the promise broken."""

    points_with_states: int = 0
    title: str = field(default="power-loss test", init=False)

    def groups(self) -> dict[str, list[Failure]]:
        """The failures by the check that failed, in order of first appearance."""
        out: dict[str, list[Failure]] = {}
        for f in self.failures:
            out.setdefault(f.check, []).append(f)
        return out

    def __str__(self) -> str:
        resumed = sum(1 for v in self.outcomes.values() if v == "resumed")
        refused = sum(1 for v in self.outcomes.values() if v == "refused")
        head = (f"{self.title}: {'ok' if self.ok else 'FAILED'} -- {len(self.tried)} crash states after "
                f"{self.points_with_states} of {self.available} persistence points, over {self.epochs} epoch(s) "
                f"in {self.elapsed_s:.1f} s: {resumed} resumed bitwise, {refused} refused (nothing committed yet), "
                f"{len(self.failures)} violations")
        lines = [head]
        for check, group in self.groups().items():
            lines.append(f"{len(group)} state(s) break: {check} -- the first:")
            lines.append("  " + str(group[0]).replace("\n", "\n  "))
        return "\n".join(lines)

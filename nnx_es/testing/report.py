"""What a crash test or a fault test returns: plain values, printed readably.

``str(report)`` starts with a one-line summary (points tried, how many resumed bitwise, were
refused, diverged, failed otherwise), then names the first divergence once, with the state it
shows in (a callback's field, a scheduler, an optimizer's state key), then the failures grouped by
the promise they break: the first in full, the others by their points. ``repr(report)`` is that
summary and first divergence on one line of at most 240 characters, because pytest prints an
assertion's message object with ``saferepr``, cut to 240 characters at the default verbosity (the
middle elided), 2,400 at ``-v``: ``assert report.ok, report`` reads whole at ``-q``.
:meth:`Report.raise_for_failures` raises :class:`HarnessFailure` with the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nnx_es.errors import NnxError

__all__ = ["CrashReport", "Failure", "FaultReport", "HarnessFailure", "PowerLossReport", "Report"]

#: pytest's saferepr keeps 240 characters at the default verbosity, a quoted string two fewer
_REPR_MAX = 236


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

    @property
    def diverged(self) -> bool:
        """The run got through (or resumed) but its state differs from the reference's."""
        return self.divergence is not None or self.check.startswith("the resumed run")

    @property
    def component(self) -> str | None:
        """Where in the final checkpoint the divergence shows first: the first differing value of
        a component other than the model's weights when there is one (a callback's field, a
        scheduler's, an optimizer's state key -- nearer the cause), else the model's first tensor."""
        found = []
        for line in (self.divergence or "").splitlines():
            for prefix in ("final LAST checkpoint: ", "also differs: "):
                if line.startswith(prefix):
                    found.append(line[len(prefix):])
        return next((f for f in found if not f.startswith("model[")), found[0] if found else None)


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

    def summary(self) -> str:
        """One line: the verdict and how many points resumed bitwise, were refused, diverged or failed."""
        resumed = sum(1 for v in self.outcomes.values() if v == "resumed")
        refused = sum(1 for v in self.outcomes.values() if v == "refused")
        diverged = sum(1 for f in self.failures if f.diverged)
        other = len(self.failures) - diverged
        counts = [f"{resumed} resumed bitwise", f"{refused} refused (nothing committed yet)"]
        if self.failures:
            counts.append(f"{len(self.failures)} failed ({diverged} diverged, {other} otherwise)" if diverged and other
                          else f"{len(self.failures)} failed ({'diverged' if diverged else 'did not diverge'})")
        else:
            counts.append("0 failed")
        return (f"{self.title}: {'ok' if self.ok else 'FAILED'} -- {len(self.tried)} of {self.available} points "
                f"over {self.epochs} epoch(s) in {self.elapsed_s:.1f} s: {', '.join(counts)}")

    def first_divergence(self) -> str | None:
        """The first failing point's divergence on one line: the point, the state it shows in
        (:attr:`Failure.component`), then the first step that differs; ``None`` with no divergence."""
        f = next((f for f in self.failures if f.divergence), None)
        if f is None or f.divergence is None:
            return None
        step = next((line for line in f.divergence.splitlines() if line.startswith("step ")), None)
        parts = [f.component] if f.component else []
        if step:
            parts.append(step.replace(", the first update after the resume that differs", ""))
        return f"first divergence at {f.point}: " + "; ".join(parts)

    def groups(self) -> dict[str, list[Failure]]:
        """The failures by the check that failed, in order of first appearance."""
        out: dict[str, list[Failure]] = {}
        for f in self.failures:
            out.setdefault(f.check, []).append(f)
        return out

    def _group_lines(self, noun: str) -> list[str]:
        lines = []
        for check, group in self.groups().items():
            points = ", ".join(f.point for f in group[:12]) + (f", ... ({len(group) - 12} more)" if len(group) > 12 else "")
            lines.append(f"{len(group)} {noun}(s) break: {check} -- {points}; the first:")
            lines.append("  " + str(group[0]).replace("\n", "\n  "))
        return lines

    def __str__(self) -> str:
        first = self.first_divergence()
        return "\n".join([self.summary(), *([first] if first else []), *self._group_lines("point")])

    def __repr__(self) -> str:  # pytest prints an assertion's message object with saferepr (240 characters)
        first = self.first_divergence()
        line = self.summary() + (f" | {first}" if first else "")
        return line if len(line) <= _REPR_MAX else line[:_REPR_MAX - 3] + "..."

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

    def summary(self) -> str:
        resumed = sum(1 for v in self.outcomes.values() if v == "resumed")
        refused = sum(1 for v in self.outcomes.values() if v == "refused")
        return (f"{self.title}: {'ok' if self.ok else 'FAILED'} -- {len(self.tried)} crash states after "
                f"{self.points_with_states} of {self.available} persistence points, over {self.epochs} epoch(s) "
                f"in {self.elapsed_s:.1f} s: {resumed} resumed bitwise, {refused} refused (nothing committed yet), "
                f"{len(self.failures)} violations")

    def __str__(self) -> str:
        first = self.first_divergence()
        return "\n".join([self.summary(), *([first] if first else []), *self._group_lines("state")])

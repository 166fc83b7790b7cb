"""``diagnose(run_dir)`` (``nnx_es.diagnose``, ``nnx-es diagnose RUN``): what went wrong in a run, each
finding with its evidence.

Read from the run's committed view only (:func:`nnx_es.plotting.committed_of`): the history
records (per-epoch losses), the step receipts (per-update loss, gradient norm when it was
computed, clipping), the skipped updates (``update_skipped``; reason ``nonfinite`` when a loss or
gradient was not finite) and the ``diagnostics_recorded`` events of :class:`~nnx_es.Diagnostics`.
A run without that callback is still checked for what the receipts and history tell (skipped
updates, the gap, a plateau; exploding gradients when the receipts carry a norm:
``track_grad_norm=True`` or clipping). The checks and the sources of their thresholds:
:mod:`nnx_es.diagnostics.checks`. A check without the data it needs is listed as not checked,
with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from events.codec import partial_decoder
from events.schema import (
    DiagnosticsRecorded,
    HistoryAppended,
    MicrobatchDone,
    RunFailed,
    RunFinalized,
    RunStarted,
    UpdateCommitted,
    UpdateSkipped,
)
from nnx_es.cli._format import printable
from nnx_es.diagnostics.checks import CHECKS, Finding, RunRecord, Thresholds
from projections.view import MicrobatchRequired

__all__ = ["Diagnosis", "Finding", "RunRecord", "Thresholds", "diagnose", "read_run"]


_decode = partial_decoder({MicrobatchDone: MicrobatchRequired})
_TYPES = (RunStarted, UpdateCommitted, UpdateSkipped, HistoryAppended, DiagnosticsRecorded, RunFailed, RunFinalized)


def read_run(run_dir: str | Path) -> RunRecord:
    """Read the committed view of ``run_dir`` for :func:`diagnose` (read-only; safe on someone else's run).

    Raises:
        NotARunError / UnsafePathError / EventLogError: as :func:`nnx_es.audit.open_run_log`.
        CorruptEventError: a stored event does not decode.
    """
    from nnx_es.audit import open_run_log
    from nnx_es.plotting import committed_of

    run_dir = Path(run_dir)
    out = RunRecord(run_id=run_dir.name)
    first_optimizer: str | None = None
    with open_run_log(run_dir) as log:
        for _, e in committed_of(log, _TYPES, _decode):
            t = type(e)
            if t is UpdateCommitted:
                if first_optimizer is None:
                    first_optimizer = e.optimizer
                if e.optimizer == first_optimizer:
                    out.steps.append(e.step)
                    out.losses.append(e.loss)
                    out.grad_norms.append(math.nan if e.grad_norm is None else e.grad_norm)
                    out.clipped.append(e.clipped)
            elif t is UpdateSkipped:
                out.skipped.append(e)
            elif t is HistoryAppended:
                out.history.append(e.record)
            elif t is DiagnosticsRecorded:
                out.records.append(e)
            elif t is RunStarted:
                out.run_id = e.run_id
            elif t is RunFailed:
                out.failure = f"{e.error_type}: {e.message}"
            elif t is RunFinalized:
                out.status = e.status
    out.records.sort(key=lambda r: r.step)
    return out


@dataclass(frozen=True)
class Diagnosis:
    """What :func:`diagnose` found in one run: ``findings`` (empty: nothing to report), the checks
    made (``checked``) and those it could not make, with why (``not_checked``)."""

    run_dir: Path
    run: RunRecord
    findings: tuple[Finding, ...]
    checked: tuple[str, ...]
    not_checked: dict[str, str]
    thresholds: Thresholds

    @property
    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able builtins (``nnx-es diagnose --json``)."""
        return {
            "run": self.run.run_id, "status": self.run.status, "epochs": len(self.run.history),
            "updates": len(self.run.steps), "records": len(self.run.records),
            "findings": [asdict(f) for f in self.findings], "checked": list(self.checked),
            "not_checked": dict(self.not_checked), "thresholds": asdict(self.thresholds),
        }

    def __str__(self) -> str:
        run = self.run
        every = _cadence(run.records)
        lines = [f"run {run.run_id} ({run.status}{': ' + run.failure if run.failure else ''}): "
                 f"{len(run.history)} epochs, {len(run.steps)} updates committed, {len(run.skipped)} skipped, "
                 f"{len(run.records)} diagnostics records" + (f" (every {every} updates)" if every else "")]
        if not self.findings:
            lines.append(f"no findings ({', '.join(self.checked)} checked)")
        else:
            lines.append(f"{len(self.findings)} finding{'s' if len(self.findings) > 1 else ''}:")
            for f in self.findings:
                lines.append(f"  [{f.code}] {f.title}")
                lines.extend(f"      {e}" for e in f.evidence)
                lines.append(f"      try: {f.advice}")
                lines.append(f"      threshold: {f.threshold}")
        for check, why in self.not_checked.items():
            lines.append(f"not checked: {check} ({why})")
        if run.records:
            lines.extend(_last_record_table(run.records[-1]))
        return "\n".join(printable(line) for line in lines)


def _cadence(records: Sequence[DiagnosticsRecorded]) -> int | None:
    gaps = {b.step - a.step for a, b in zip(records, records[1:]) if b.step > a.step}
    return min(gaps) if gaps else None


def _last_record_table(r: DiagnosticsRecorded) -> list[str]:
    lines = [f"layers at the last record (step {r.step}, epoch {r.epoch}):",
             f"  {'layer':<24} {'grad_norm':>10} {'weight_norm':>11} {'update/weight':>13}"]
    for name in r.weight_norm:
        lines.append(f"  {name[:24]:<24} {r.grad_norm.get(name, math.nan):>10.3g} {r.weight_norm[name]:>11.3g} "
                     f"{r.update_ratio.get(name, math.nan):>13.3g}")
    if r.activation_mean:
        lines.append(f"  {'activation':<24} {'mean':>10} {'std':>11} {'dead':>13}")
        for name in r.activation_mean:
            dead = r.dead_fraction.get(name)
            std = r.activation_std.get(name, math.nan)
            lines.append(f"  {name[:24]:<24} {r.activation_mean[name]:>10.3g} {std:>11.3g} "
                         f"{'' if dead is None else f'{dead:.0%}':>13}")
    return lines


def diagnose(run_dir: str | Path, thresholds: Thresholds | None = None) -> Diagnosis:
    """Check a run for the problems the module docstring lists; each finding carries its evidence.

    Reads only the run's committed view (read-only: a run someone else owns, or one still
    training, is safe to diagnose).

    Raises:
        NotARunError / UnsafePathError / EventLogError / CorruptEventError: as :func:`read_run`.
    """
    th = thresholds or Thresholds()
    run = read_run(run_dir)
    findings: list[Finding] = []
    checked: list[str] = []
    not_checked: dict[str, str] = {}
    for name, check in CHECKS:
        result = check(run, th)
        if isinstance(result, str) and result:
            not_checked[name] = result
            continue
        checked.append(name)
        if isinstance(result, Finding):
            findings.append(result)
        elif isinstance(result, list):
            findings.extend(result)
    return Diagnosis(run_dir=Path(run_dir), run=run, findings=tuple(findings), checked=tuple(checked),
                     not_checked=not_checked, thresholds=th)

"""``audit_study``: does a study say what its runs say?

A study's values are a copy: what a trial achieved is in its run's log. For every trial the audit
reads the run (:func:`nnx_es.trial_runs.run_outcome`) and reports, one line each:

* a trial whose run is missing or is another run (``run_started.run_id``);
* a parameter the run's recorded spec does not hold at its path (the trial's value changed, or the
  run was trained from another spec);
* a state the run does not support: COMPLETE for a run that did not complete or stop with a BEST,
  PRUNED for one not stopped with reason ``pruned``, FAIL for one that did not fail (nor was refused);
* a value that is not the run's: a COMPLETE trial's must equal its run's BEST monitor value, a PRUNED
  trial's its last committed epoch's monitor value (Optuna keeps the last report), each reported
  intermediate value of a committed epoch that epoch's monitor value -- bit for bit (floats compared
  as floats, ``==``);
* with ``replay``, a run whose own audit (``tools/replay``: the eleven invariants) finds a violation.

``nnx-es search --audit STUDY`` prints the lines and exits 1 when there is any.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nnx_es.errors import ConfigError, NnxError
from nnx_es.recipes.overrides import value_at
from nnx_es.plan import check_name
from nnx_es.search.report import expected_state, valid_run_id
from nnx_es.search.study import STUDIES_DIR, default_storage
from nnx_es.trial_runs import run_outcome

__all__ = ["StudyAudit", "audit_study", "load_study"]


@dataclass(frozen=True)
class StudyAudit:
    """The audit of study ``study_name``: ``trials`` checked, one line per ``finding`` (none: ok)."""

    study_name: str
    trials: int
    findings: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.findings


def load_study(study_name: str, *, storage: Any = None, runs_root: str | Path = "runs") -> Any:
    """The Optuna study ``study_name`` (in ``storage``; default: its journal under ``runs_root``), read only.

    Raises:
        ConfigError: no such study (no study directory, or the storage does not hold it).
        InvalidRunIdError: ``study_name`` is no safe directory name (with the default storage).
        UnsafePathError: the study's journal is a link.
    """
    import optuna

    if storage is None:
        directory = Path(runs_root) / STUDIES_DIR / check_name(study_name, "study name")
        if not (directory / "journal.log").is_file():
            raise ConfigError(f"no study {study_name!r} under {str(runs_root)!r} (no {directory / 'journal.log'}); "
                              "give --storage URL for a study in another storage")
        storage = default_storage(directory)
    try:
        return optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        raise ConfigError(f"the storage holds no study {study_name!r}") from None


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                             and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def audit_study(study_name: str, *, storage: Any = None, runs_root: str | Path = "runs",
                replay: bool = True) -> StudyAudit:
    """Cross-check every trial of ``study_name`` against its run (the module docstring).

    Raises:
        ConfigError: no such study (:func:`load_study`).
    """
    from nnx_es.audit import audit_run

    study = load_study(study_name, storage=storage, runs_root=runs_root)
    findings: list[str] = []
    trials = study.get_trials(deepcopy=False)
    for t in trials:
        where = f"trial {t.number} ({t.state.name})"
        run_id = t.user_attrs.get("run_id")
        if t.state.name == "WAITING":
            continue
        if not isinstance(run_id, str):
            if t.state.name != "FAIL":
                findings.append(f"{where}: records no run (user attr run_id)")
            continue
        if not valid_run_id(run_id):
            findings.append(f"{where}: records {run_id!r}, which is no run id: not read")
            continue
        run_dir = Path(runs_root) / run_id
        try:
            outcome = run_outcome(run_dir)
        except (NnxError, OSError) as exc:
            findings.append(f"{where}: its run {run_id!r} cannot be read: {type(exc).__name__}: {exc}")
            continue
        if outcome is None:
            if t.state.name not in ("FAIL", "RUNNING"):
                findings.append(f"{where}: its run {run_id!r} does not exist under {str(runs_root)!r}")
            continue
        if outcome.run_id != run_id:
            findings.append(f"{where}: {run_dir} is run {outcome.run_id!r}, not {run_id!r}")
        for path, value in t.params.items():
            held = value_at(outcome.spec or {}, path)
            if not _same(held, value):
                findings.append(f"{where}: parameter {path} is {value!r} in the study, {held!r} in its run's spec")
        want = expected_state(outcome)
        if want.name != t.state.name and not (t.state.name == "FAIL" and t.user_attrs.get("error")
                                              and not outcome.finished):
            findings.append(f"{where}: its run {run_id} is {outcome.status}"
                            f"{f' ({outcome.stop_reason})' if outcome.stop_reason else ''}: the trial should be "
                            f"{want.name}")
        if t.state.name == "COMPLETE" and not _same(t.value, outcome.best):
            findings.append(f"{where}: value {t.value!r} is not its run's BEST {outcome.monitor} {outcome.best!r} "
                            f"(epoch {outcome.best_epoch})")
        if t.state.name == "PRUNED" and outcome.values and not _same(t.value, outcome.values[-1]):
            findings.append(f"{where}: value {t.value!r} is not its run's last monitor value {outcome.values[-1]!r}")
        for epoch, reported in sorted(t.intermediate_values.items()):
            if epoch < len(outcome.values) and not _same(reported, outcome.values[epoch]):
                findings.append(f"{where}: reported {reported!r} at epoch {epoch}, its run's monitor value there is "
                                f"{outcome.values[epoch]!r}")
        if replay:
            report = audit_run(run_dir)
            if not report.ok:
                first = "; ".join(v.line() for v in report.violations[:3])
                findings.append(f"{where}: its run {run_id} does not audit clean: {first}")
    return StudyAudit(study_name=study_name, trials=len(trials), findings=tuple(findings))

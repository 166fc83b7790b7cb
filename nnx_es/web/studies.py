"""What the study pages of ``nnx-es serve`` show: the Optuna studies of ``nnx-es search`` under the runs root
(``studies/<name>/journal.log``), each trial beside its run -- built on :mod:`nnx_es.search` (its report's
:func:`~nnx_es.search.report.study_result`, its audit's :func:`~nnx_es.search.audit.load_study`), never a fold
of its own.

A journal is read as a copy in memory (:func:`nnx_es.search.study.journal_copy`): Optuna's file backend would
create the journal if missing and a lock file beside it to append; nothing under the root is written. A
trial's run is read as every run is (:meth:`nnx_es.web.reading.RunsRoot.read`: quietly, one reader of it at
a time); a run id the study records is used only when it is a run id (never a path out of the root).

| function | shows |
|---|---|
| :func:`studies` | every study: name, direction, trials, how many complete, the best value and its trial |
| :func:`study` | one study's trials: number, state, parameters, value, run id and page, the run's status and BEST |
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from events.errors import NnxError
from events.paths import check_entry
from nnx_es.errors import ConfigError
from nnx_es.web.reading import RunsRoot

__all__ = ["NoSuchStudyError", "studies", "study"]


class NoSuchStudyError(NnxError, LookupError):
    """The runs root holds no study of that name (no ``studies/<name>/journal.log``, or it holds no such study)."""


def _load(root: RunsRoot, name: str) -> Any:
    from nnx_es.search.audit import load_study
    from nnx_es.search.study import journal_copy

    storage = journal_copy(root.path, name)
    if storage is None:
        raise NoSuchStudyError(f"no study {name!r} under {root.path} (no studies/{name}/journal.log)")
    try:
        return load_study(name, storage=storage)
    except ConfigError:
        raise NoSuchStudyError(f"the journal of studies/{name} holds no study {name!r}") from None


def _best(study: Any) -> dict[str, Any] | None:
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE" and t.value is not None]
    if not complete:
        return None
    sign = -1.0 if study.direction.name == "MAXIMIZE" else 1.0
    t = min(complete, key=lambda t: (sign * t.value, t.number))
    return {"value": t.value, "trial": t.number, "run_id": t.user_attrs.get("run_id")}


def studies(root: RunsRoot) -> dict[str, Any]:
    """Every study under the root, by name; one that cannot be read says why (``error``)."""
    from nnx_es.search.study import study_names

    rows = []
    for name in study_names(root.path):
        try:
            s = _load(root, name)
            trials = s.get_trials(deepcopy=False)
            best = _best(s)
            rows.append({"name": name, "direction": s.direction.name.lower(), "trials": len(trials),
                         "complete": sum(t.state.name == "COMPLETE" for t in trials),
                         "best": best["value"] if best else None, "best_trial": best["trial"] if best else None,
                         "error": None})
        except Exception as exc:  # noqa: BLE001 - one unreadable study does not hide the others
            rows.append({"name": name, "direction": None, "trials": None, "complete": None, "best": None,
                         "best_trial": None, "error": f"{type(exc).__name__}: {exc}"})
    return {"root": str(root.path), "studies": rows}


def study(root: RunsRoot, name: str) -> dict[str, Any]:
    """Study ``name``'s trials in trial order, each with its run's outcome (status, stop reason, BEST).

    Raises:
        InvalidRunIdError: ``name`` is no study name. UnsafePathError: a link on the way (or a trial's run
        is a link). NoSuchStudyError: no such study.
    """
    from nnx_es.search.report import study_result, valid_run_id

    s = _load(root, name)
    ids = {t.user_attrs.get("run_id") for t in s.get_trials(deepcopy=False)}
    present = sorted(i for i in ids if valid_run_id(i) and check_entry(root.path / i, "dir") is not None)
    result = root.read(lambda *_dirs: study_result(s, root.path), *present)
    best = result.best
    trials = []
    for r in result.rows:
        o = r.outcome
        trials.append({
            "number": r.number, "state": r.state, "params": r.params, "value": r.value, "run_id": r.run_id,
            "run_url": f"/runs/{r.run_id}" if r.run_id is not None and o is not None else None,
            "run_status": o.status if o is not None else None, "run_stop_reason": o.stop_reason if o else None,
            "run_best": o.best if o is not None else None, "run_best_epoch": o.best_epoch if o is not None else None,
            "monitor": o.monitor if o is not None else None, "error": r.error,
        })
    return {"name": result.study_name, "direction": result.direction, "trials": trials,
            "best": None if best is None else {"trial": best.number, "value": best.value, "run_id": best.run_id}}

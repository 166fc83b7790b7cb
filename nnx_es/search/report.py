"""What a search found: the study's trials beside their runs' own outcomes, a table and two plots.

Each row pairs a trial (number, state, parameters, the value the study holds) with its run's
outcome read from the run's log (:func:`nnx_es.trial_runs.run_outcome`): status, stop reason,
BEST. The plots are Optuna's own, through its matplotlib backend: the optimization history and the
parameter importances (``pip install 'nnx_es[plots]'`` for matplotlib).
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from nnx_es.errors import InvalidRunIdError
from nnx_es.lease import validate_run_id
from nnx_es.recipes.overrides import label
from nnx_es.storage import atomic_write
from nnx_es.trial_runs import RunOutcome, run_outcome

__all__ = ["SearchResult", "SearchRow", "expected_state", "study_result", "valid_run_id"]


def valid_run_id(run_id: Any) -> bool:
    """Whether ``run_id`` (a study's user attribute) is a run id (:func:`nnx_es.lease.validate_run_id`)."""
    try:
        validate_run_id(run_id)
    except InvalidRunIdError:
        return False
    return True


def expected_state(outcome: RunOutcome | None) -> TrialState:
    """The state a trial whose run ended as ``outcome`` is told: PRUNED for a run stopped with reason
    ``pruned``, COMPLETE for another completed or stopped run with a BEST, FAIL otherwise (a failed
    run, no run, no BEST); RUNNING while the run has not ended."""
    if outcome is None:
        return TrialState.FAIL
    if not outcome.finished:
        return TrialState.RUNNING
    if outcome.status == "stopped" and outcome.stop_reason == "pruned":
        return TrialState.PRUNED
    if outcome.status in ("completed", "stopped") and outcome.best is not None:
        return TrialState.COMPLETE
    return TrialState.FAIL


@dataclass(frozen=True)
class SearchRow:
    """One trial: Optuna's number, state and parameters, the value the study holds, its run and its outcome."""

    number: int
    state: str
    params: dict[str, Any]
    value: float | None
    run_id: str | None
    outcome: RunOutcome | None
    error: str | None = None


@dataclass(frozen=True)
class SearchResult:
    """A study's trials (in trial order) with their runs' outcomes. ``study``: the Optuna study."""

    study_name: str
    direction: str
    rows: tuple[SearchRow, ...]
    study: Any = field(repr=False, compare=False)

    def ranked(self) -> list[SearchRow]:
        """COMPLETE trials best first by the study's direction, then PRUNED ones (by their last value), then
        the rest, each in trial order on ties."""
        sign = -1.0 if self.direction == "maximize" else 1.0
        order = {"COMPLETE": 0, "PRUNED": 1}

        def key(r: SearchRow) -> tuple[int, float, int]:
            return (order.get(r.state, 2), sign * r.value if r.value is not None and r.state in order else 0.0,
                    r.number)
        return sorted(self.rows, key=key)

    @property
    def best(self) -> SearchRow | None:
        """The best COMPLETE trial (None: none completed)."""
        ranked = self.ranked()
        return ranked[0] if ranked and ranked[0].state == "COMPLETE" else None

    def table(self) -> str:
        """The ranked trials as an aligned text table: trial, state, the study's value, the run's BEST,
        its status and id, the parameters."""
        rows = [("trial", "state", "value", "run BEST", "run status", "run", "parameters")]
        for r in self.ranked():
            o = r.outcome
            status = (o.status + (f" ({o.stop_reason})" if o.stop_reason else "")) if o is not None else "-"
            params = label(r.params)
            rows.append((str(r.number), r.state, f"{r.value:.6g}" if r.value is not None else "-",
                         f"{o.best:.6g}" if o is not None and o.best is not None else "-", status, r.run_id or "-",
                         params))
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        best = self.best
        tail = (f"best: trial {best.number} value {best.value:.6g} (run {best.run_id})" if best is not None
                else "best: no complete trial")
        return "\n".join([f"study {self.study_name} ({self.direction}): {len(self.rows)} trials", *lines, tail])

    def plots(self, directory: str | Path) -> list[Path]:
        """Write ``history.png`` (the optimization history) and, with two or more complete trials,
        ``importances.png`` (parameter importances) into ``directory``; return the files written.

        Raises:
            ImportError: matplotlib is not installed (``pip install 'nnx_es[plots]'``).
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.visualization.matplotlib import plot_optimization_history, plot_param_importances

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        figures = {"history.png": plot_optimization_history}
        complete = [r for r in self.rows if r.state == "COMPLETE"]
        if len(complete) >= 2 and any(r.params for r in complete):
            figures["importances.png"] = plot_param_importances
        written = []
        for name, plot in figures.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the matplotlib backend is marked experimental
                ax = plot(self.study)
            ax.figure.tight_layout()
            png = io.BytesIO()
            ax.figure.savefig(png, format="png")
            plt.close(ax.figure)
            atomic_write(directory / name, png.getvalue(), root=directory)  # a link there is replaced, never written
            written.append(directory / name)
        return written


def study_result(study: Any, runs_root: str | Path) -> SearchResult:
    """The :class:`SearchResult` of ``study`` (an Optuna study) whose runs are under ``runs_root``.

    Raises:
        UnsafePathError / EventLogError: a trial's run directory holds a link or a damaged log.
    """
    rows = []
    for t in study.get_trials(deepcopy=False):
        run_id = t.user_attrs.get("run_id")
        run_id = run_id if valid_run_id(run_id) else None  # the study is input too: never a path out of the root
        outcome = run_outcome(Path(runs_root) / run_id) if run_id is not None else None
        rows.append(SearchRow(number=t.number, state=t.state.name, params=dict(t.params), value=t.value,
                              run_id=run_id, outcome=outcome, error=t.user_attrs.get("error")))
    return SearchResult(study_name=study.study_name, direction=study.direction.name.lower(), rows=tuple(rows),
                        study=study)

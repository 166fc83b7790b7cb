"""``ExperimentPlan``: a base spec and a list or grid of overrides and seeds, each trial its own run.

    plan = ExperimentPlan(spec, name="lr", grid={"optimizers.main.kwargs.lr": [1e-3, 3e-3]}, seeds=[0, 1])
    report = plan.fit(runs_root="runs")     # four runs: runs/lr-000 ... runs/lr-003
    print(report.table())                   # ranked by each run's BEST, read from the runs' logs

Spec 000 names ``ExperimentPlan.fit`` beside ``Trainer.train``: it trains in one process and refuses a
process group of more than one rank ("Out of scope"). How it works:

* **trials**: the overrides (a list of ``{path: value}``, or the product of a ``grid``'s values in
  the order given), each with each of ``seeds`` (innermost); a path sets plain data only and every
  trial's spec is validated like any spec before anything trains (:mod:`nnx_es.recipes.overrides`).
  Trial ``i`` is the run ``<name>-<i:03d>``.
* **its log**: ``RUNS_ROOT/plans/<name>/events.lmdb`` (:mod:`nnx_es.plan_log`, :mod:`events.plans`):
  ``plan_started`` with the declaration (base spec, each trial's overrides and seed), then
  ``trial_started`` / ``trial_ended`` per trial, ``plan_finished``; each synced before the next step.
* **a restart** (after a kill, Ctrl-C, a reboot) of the same plan: ended trials are not run again;
  the trial that was running continues its run from its LAST (``Trainer.fit(resume="auto")``: bit for
  bit as if never stopped; a run killed before its first LAST starts afresh); pending ones start. A
  different declaration under the same name is refused. A run that finished before its
  ``trial_ended`` was written is taken as it is.
* **the report** ranks the trials by their runs' BEST (the monitor's mode), read from each run's own
  log (:func:`nnx_es.trial_runs.run_outcome`); the plan log's copy is only cross-checked (a
  disagreement is a note of the report).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from events.plans import PlanFinished, PlanResumed, PlanStarted, TrialEnded, TrialStarted
from events.specs import canonical_hash
from nnx_es.errors import ConfigError, InvalidRunIdError, RecipeError
from nnx_es.lease import validate_run_id
from nnx_es.plan_log import PLANS_DIR, PlanLog, read_plan
from nnx_es.recipes.imports import Allowed
from nnx_es.recipes.overrides import apply_overrides, check_path, check_value, label
from nnx_es.recipes.runspec import RunSpec, decode_spec, load_spec, read_document, validate_spec
from nnx_es.trial_runs import RunOutcome, better, run_outcome, train_trial

__all__ = ["ExperimentPlan", "PlanReport", "PlanRow", "PlanTrial", "check_name", "single_process"]

#: the longest plan name (its runs' ids add ``-NNN`` and must stay within 128 characters)
MAX_NAME = 100


def check_name(name: Any, what: str) -> str:
    """``name`` when it can name a plan or a study: ``[A-Za-z0-9._-]``, at most :data:`MAX_NAME` characters
    (its runs' ids add a suffix; :func:`nnx_es.lease.validate_run_id`'s rule otherwise).

    Raises:
        InvalidRunIdError: naming ``what`` and the value.
    """
    try:
        if not isinstance(name, str) or len(name) > MAX_NAME:
            raise InvalidRunIdError("too long")
        return validate_run_id(name)
    except InvalidRunIdError:
        raise InvalidRunIdError(f"{what} must be 1-{MAX_NAME} characters of [A-Za-z0-9._-], not '.' or '..', got "
                                f"{name!r}") from None


def single_process(entry: str) -> None:
    """Refuse ``entry`` inside a process group of more than one rank (spec 000, "Out of scope": plans and
    searches train in one process).

    Raises:
        ConfigError: ``WORLD_SIZE`` > 1 or an initialized group of more than one rank.
    """
    from nnx_es.distributed.group import env_world_size

    size = env_world_size()
    if size > 1:
        raise ConfigError(f"{entry} trains in one process, but this process is one of {size} ranks (WORLD_SIZE / an "
                          "initialized process group); run it without torchrun (each trial is a run of one process)")


def as_spec(spec: RunSpec | Mapping[str, Any] | str | Path) -> RunSpec:
    """A :class:`RunSpec` from itself, its JSON mapping, or the path of a spec file."""
    if isinstance(spec, RunSpec):
        return spec
    if isinstance(spec, (str, Path)):
        return load_spec(spec)
    if isinstance(spec, Mapping):
        return decode_spec(dict(spec))
    raise ConfigError(f"spec must be a RunSpec, its JSON mapping or a spec file's path, got {type(spec).__name__}")


@dataclass(frozen=True)
class PlanTrial:
    """One trial: its 0-based ``index``, run id, overrides (dotted path -> value), seed and resulting spec."""

    index: int
    run_id: str
    overrides: dict[str, Any]
    seed: int
    spec: RunSpec

    def label(self) -> str:
        """``name=value ... seed=S`` (:func:`~nnx_es.recipes.overrides.label`)."""
        return " ".join(filter(None, [label({p: v for p, v in self.overrides.items() if p != "seed"}),
                                      f"seed={self.seed}"]))


class _PlanFile(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    spec: str | dict[str, Any]
    grid: dict[str, list[Any]] | None = None
    overrides: list[dict[str, Any]] | None = None
    seeds: list[int] | None = None
    format: int = 1


class ExperimentPlan:
    """A base spec and its trials; :meth:`fit` runs each as its own run under one runs root.

    Args:
        spec: the base spec (:class:`~nnx_es.recipes.runspec.RunSpec`, its JSON mapping, or a file: the
            format ``nnx-es init`` writes).
        name: the plan's name, ``[A-Za-z0-9._-]``, at most 100 characters: its log is
            ``RUNS_ROOT/plans/<name>``, trial ``i``'s run ``RUNS_ROOT/<name>-<i:03d>``.
        grid: ``{path: [values]}``: a trial per combination (the product, in the order given).
        overrides: ``[{path: value}, ...]``: a trial each (give ``grid`` or ``overrides``, not both).
        seeds: each override set once per seed (the spec's ``seed``: initial weights and training RNG);
            default: the spec's own seed.
        allow: packages besides torch and nnx_es the spec's recipes may import (``--allow``).

    Raises:
        ConfigError / RecipeError / UnsafeRecipeError: a bad name, grid, seed, path (one that names
            code or a recipe: :mod:`nnx_es.recipes.overrides`) or a trial's spec that does not
            validate -- all before anything is written or trained.
    """

    def __init__(self, spec: RunSpec | Mapping[str, Any] | str | Path, *, name: str,
                 grid: Mapping[str, Sequence[Any]] | None = None,
                 overrides: Sequence[Mapping[str, Any]] | None = None, seeds: Sequence[int] | None = None,
                 allow: Sequence[str] = ()) -> None:
        self.name = check_name(name, "plan name")
        self.spec = as_spec(spec)
        self.allowed = Allowed(allow)
        validate_spec(self.spec, self.allowed)
        sets = self._override_sets(grid, overrides)
        seeds = list(seeds) if seeds is not None else [self.spec.seed]
        if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**63 for s in seeds):
            raise ConfigError(f"seeds must be a non-empty list of ints in [0, 2**63), got {seeds!r}")
        if seeds != [self.spec.seed] and any("seed" in s for s in sets):
            raise ConfigError("the plan sets 'seed' both in its overrides and by seeds=: give one of them")
        for path in dict.fromkeys(p for s in sets for p in s):
            check_path(self.spec, path, self.allowed)
        trials = []
        for values in sets:
            for seed in seeds:
                i = len(trials)
                spec = apply_overrides(self.spec, {**values, "seed": seed} if "seed" not in values else values,
                                       self.allowed)
                trials.append(PlanTrial(i, f"{self.name}-{i:03d}", dict(values), spec.seed, spec))
        self.trials: tuple[PlanTrial, ...] = tuple(trials)

    @staticmethod
    def _override_sets(grid: Mapping[str, Sequence[Any]] | None,
                       overrides: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
        if grid is not None and overrides is not None:
            raise ConfigError("give a plan's trials as grid= or as overrides=, not both")
        if grid is not None:
            if not isinstance(grid, Mapping) or not all(isinstance(v, (list, tuple)) and v for v in grid.values()):
                raise ConfigError(f"grid must map each path to a non-empty list of values, got {grid!r}")
            sets = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]
        elif overrides is not None:
            if isinstance(overrides, Mapping) or not all(isinstance(o, Mapping) for o in overrides) or not overrides:
                raise ConfigError(f"overrides must be a non-empty list of {{path: value}}, got {overrides!r}")
            sets = [dict(o) for o in overrides]
        else:
            sets = [{}]
        for s in sets:
            for path, value in s.items():
                check_value(path, value)
        return sets

    @classmethod
    def load(cls, path: str | Path, *, allow: Sequence[str] = ()) -> ExperimentPlan:
        """A plan from a JSON file: ``{"name": ..., "spec": "spec.json" (beside the plan file) or {...},
        "grid": {path: [values]} or "overrides": [{path: value}, ...], "seeds": [...]}``.

        Raises:
            RecipeError: the file cannot be read or does not decode (named); and see the constructor.
        """
        data = read_document(path, "plan")
        try:
            doc = msgspec.json.decode(data, type=_PlanFile)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RecipeError(f"plan {str(path)!r}: {exc} (a plan is {{'name', 'spec', 'grid' or 'overrides', "
                              "'seeds'}})") from None
        except RecursionError:
            raise RecipeError(f"plan {str(path)!r}: nested too deep to decode") from None
        spec = as_spec(Path(path).parent / doc.spec) if isinstance(doc.spec, str) else as_spec(doc.spec)
        return cls(spec, name=doc.name, grid=doc.grid, overrides=doc.overrides, seeds=doc.seeds, allow=allow)

    def declaration(self) -> dict[str, Any]:
        """What ``plan_started`` records: the base spec and each trial's overrides and seed (JSON)."""
        return {"format": 1, "name": self.name, "spec": msgspec.to_builtins(self.spec),
                "trials": [{"overrides": t.overrides, "seed": t.seed} for t in self.trials]}

    def fit(self, runs_root: str | Path = "runs", *, echo: Callable[[str], None] | None = None,
            progress: bool | None = None) -> PlanReport:
        """Run every trial not ended yet (see the module docstring); return the report.

        ``echo``: called with one line as each trial starts and ends (``print`` for a console).
        ``progress``: each run's progress display (default: when stderr is a terminal).

        Raises:
            ConfigError: a process group of more than one rank; another declaration under this name; a
                run directory of a trial this plan did not start.
            LeaseHeldError: another process runs this plan (or writes one of its runs).
            UnsafePathError / EventLogError: a link or damage under the runs root (nothing trained there).
        """
        single_process("ExperimentPlan.fit")
        runs_root = Path(runs_root)
        say = echo or (lambda line: None)
        declaration = self.declaration()
        digest = canonical_hash(declaration)
        with PlanLog(runs_root, self.name) as plan_log:
            started = plan_log.state.started
            if started is None:
                from nnx_es.runtime.session import library_versions

                plan_log.commit(PlanStarted(name=self.name, declaration=declaration, declaration_hash=digest,
                                            trials=len(self.trials), library_versions=library_versions(),
                                            wall_time_s=time.time()))
            elif started.declaration_hash != digest:
                raise ConfigError(
                    f"plan {self.name!r} under {str(runs_root)!r} was started with another declaration (hash "
                    f"{started.declaration_hash[:12]}..., this one {digest[:12]}...): refused; give this plan "
                    f"another name, or remove {str(runs_root / PLANS_DIR / self.name)!r} and its runs to start over")
            elif plan_log.state.finished:
                say(f"plan {self.name}: finished before; nothing to run")
                return self.report(runs_root)
            else:
                plan_log.commit(PlanResumed(ended=plan_log.state.ended, wall_time_s=time.time()))
                say(f"plan {self.name}: resumed, {plan_log.state.ended} of {len(self.trials)} trials ended before")
            for trial in self.trials:
                self._run_trial(trial, plan_log, runs_root, say, progress)
            statuses: dict[str, int] = {}
            for t in plan_log.state.trials.values():
                if t.ended is not None:
                    statuses[t.ended.status] = statuses.get(t.ended.status, 0) + 1
            plan_log.commit(PlanFinished(statuses=statuses, wall_time_s=time.time()))
        return self.report(runs_root)

    def _run_trial(self, trial: PlanTrial, plan_log: PlanLog, runs_root: Path, say: Callable[[str], None],
                   progress: bool | None) -> None:
        known = plan_log.state.trials.get(trial.index)
        if known is not None and known.state == "ended":
            return
        run_dir = runs_root / trial.run_id
        if known is None and (run_dir.exists() or run_dir.is_symlink()):
            raise ConfigError(f"run directory {str(run_dir)!r} exists but plan {self.name!r} never started trial "
                              f"{trial.index}: refused (not resumed or cleared); move it away, or rename the plan")
        plan_log.commit(TrialStarted(index=trial.index, run_id=trial.run_id, overrides=trial.overrides,
                                     seed=trial.seed, resumed=known is not None, wall_time_s=time.time()))
        n = len(self.trials)
        say(f"trial {trial.index + 1}/{n} {trial.run_id} [{trial.label()}]: "
            f"{'resuming' if known is not None else 'starting'}")
        done = train_trial(trial.spec, runs_root=runs_root, run_id=trial.run_id, allowed=self.allowed,
                           progress=progress)
        o = done.outcome
        status = o.status if o is not None and o.finished else "refused"
        plan_log.commit(TrialEnded(
            index=trial.index, run_id=trial.run_id, status=status, stop_reason=o.stop_reason if o else None,
            monitor=o.monitor if o else None, best=o.best if o else None, best_epoch=o.best_epoch if o else None,
            epochs=o.epochs if o else 0, error=done.error, wall_time_s=time.time()))
        best = f", best {o.monitor} {o.best:.6g} (epoch {o.best_epoch})" if o is not None and o.best is not None else ""
        why = f" ({o.stop_reason})" if o is not None and o.stop_reason else ""
        say(f"trial {trial.index + 1}/{n} {trial.run_id}: {status}{why}{best}"
            + (f": {done.error}" if done.error and status != "completed" else ""))

    def report(self, runs_root: str | Path = "runs") -> PlanReport:
        """The trials ranked by their runs' BEST, read from each run's own log (and the plan log, whose
        copies are cross-checked: a disagreement is a note).

        Raises:
            UnsafePathError / EventLogError / CorruptEventError: a link or damage (named).
        """
        runs_root = Path(runs_root)
        state = read_plan(runs_root, self.name)
        rows, notes = [], []
        for trial in self.trials:
            logged = state.trials.get(trial.index) if state is not None else None
            outcome = run_outcome(runs_root / trial.run_id)
            ended = logged.ended if logged is not None else None
            if ended is not None and outcome is not None and outcome.finished and (
                    ended.status, ended.best, ended.best_epoch) != (outcome.status, outcome.best, outcome.best_epoch):
                notes.append(f"trial {trial.index} ({trial.run_id}): the plan log says {ended.status}, best "
                             f"{ended.best} (epoch {ended.best_epoch}); its run says {outcome.status}, best "
                             f"{outcome.best} (epoch {outcome.best_epoch}): the run's log is the record")
            state_name = ("ended" if ended is not None else "started" if logged is not None else "pending")
            rows.append(PlanRow(trial=trial, outcome=outcome, state=state_name,
                                error=ended.error if ended is not None else None))
        return PlanReport(name=self.name, runs_root=str(runs_root), rows=tuple(rows), notes=tuple(notes))


@dataclass(frozen=True)
class PlanRow:
    """One trial in a report: the trial, its run's outcome (None: no run yet), and its state in the plan log
    (``pending`` / ``started`` / ``ended``)."""

    trial: PlanTrial
    outcome: RunOutcome | None
    state: str
    error: str | None = None

    @property
    def status(self) -> str:
        if self.outcome is None:
            return "refused" if self.state == "ended" else self.state
        return self.outcome.status


@dataclass(frozen=True)
class PlanReport:
    """A plan's trials with their runs' outcomes, in trial order (:meth:`ranked`: best first)."""

    name: str
    runs_root: str
    rows: tuple[PlanRow, ...]
    notes: tuple[str, ...] = ()

    def ranked(self) -> list[PlanRow]:
        """The rows with a BEST, best first by the monitor's mode; then the others in trial order."""
        scored = [r for r in self.rows if r.outcome is not None and r.outcome.best is not None]
        mode = scored[0].outcome.mode if scored else None  # type: ignore[union-attr]
        ordered: list[PlanRow] = []
        for r in scored:  # a stable insertion: ties keep trial order
            at = next((i for i, o in enumerate(ordered) if better(r.outcome.best, o.outcome.best, mode)),  # type: ignore[union-attr, arg-type]
                      len(ordered))
            ordered.insert(at, r)
        return ordered + [r for r in self.rows if r not in scored]

    @property
    def best(self) -> PlanRow | None:
        """The trial whose run has the best BEST (None: no run has one)."""
        ranked = self.ranked()
        return ranked[0] if ranked and ranked[0].outcome is not None and ranked[0].outcome.best is not None else None

    def table(self) -> str:
        """The ranked trials as an aligned text table (rank, run, status, best, epoch, overrides)."""
        rows = [("rank", "run", "status", "best", "epoch", "trial")]
        for i, r in enumerate(self.ranked(), 1):
            o = r.outcome
            status = r.status + (f" ({o.stop_reason})" if o is not None and o.stop_reason else "")
            rows.append((str(i) if o is not None and o.best is not None else "-", r.trial.run_id, status,
                         f"{o.best:.6g}" if o is not None and o.best is not None else "-",
                         str(o.best_epoch) if o is not None and o.best_epoch is not None else "-", r.trial.label()))
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        monitor = next((r.outcome.monitor for r in self.rows if r.outcome is not None and r.outcome.monitor), None)
        head = f"plan {self.name}: {len(self.rows)} trials" + (f", ranked by BEST {monitor}" if monitor else "")
        return "\n".join([head, *lines, *(f"note: {n}" for n in self.notes)])

"""``search``: a hyper-parameter search on Optuna whose every trial is an audited nnx_es run.

    from nnx_es.search import search
    result = search("spec.json", {"optimizers.main.kwargs.lr": {"float": [1e-4, 1e-1], "log": True}},
                    n_trials=20, runs_root="runs")
    print(result.table())

The loop of one worker (several may share a study: other processes, other machines on an RDB URL)::

    under the study's claim lease:
        a RUNNING trial no live worker holds (its worker was killed)  -> take it, same number
        else fewer than n_trials trials                               -> study.ask(), take it
        else                                                          -> done
    run the trial: its parameters from the trial (a resumed trial keeps its own), its spec = the base
        spec with them set (plain data only) and the pruning callback; its run <study>-t<number:03d>
        trained with resume="auto" (a killed trial continues from its LAST, bit for bit)
    tell the study: COMPLETE with the run's BEST monitor value; PRUNED (the run stopped, reason
        "pruned"); FAIL (the run failed, or its spec was refused: the error in user attr "error")

Spec 000 names ``nnx.search.search`` beside ``Trainer.train``: it trains in one process and refuses a
process group of more than one rank ("Out of scope").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import optuna
from optuna.trial import TrialState

from events.specs import canonical_hash
from nnx_es.errors import ConfigError, NnxError
from nnx_es.lease import Lease
from nnx_es.plan import as_spec, check_name, single_process
from nnx_es.recipes.core import Recipe, from_spec
from nnx_es.recipes.imports import Allowed
from nnx_es.recipes.overrides import apply_overrides, check_path, label
from nnx_es.recipes.runspec import RunSpec, validate_spec
from nnx_es.search.pruning import TrialPruning
from nnx_es.search.report import SearchResult, expected_state, study_result
from nnx_es.search.sampler import sampler as named_sampler
from nnx_es.search.space import Dist, parse_space, space_json, suggest
from nnx_es.search.study import Claims, default_storage, study_dir
from nnx_es.trial_runs import RunOutcome, train_trial

__all__ = ["STUDY_ATTR", "run_id_of", "search"]

#: the study's user attribute that records what it searches (its spec's hash, space, monitor)
STUDY_ATTR = "nnx_es"
_PRUNING = Recipe(target="nnx_es.search.pruning:TrialPruning", kwargs={})


def run_id_of(study_name: str, number: int) -> str:
    """The run of trial ``number`` of study ``study_name``: ``<study>-t<number:03d>``."""
    return f"{study_name}-t{number:03d}"


@contextmanager
def _quiet_optuna() -> Iterator[None]:
    """Optuna's INFO lines ("A new study created ...") off for the block: the search says what it does."""
    logger = logging.getLogger("optuna")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _with_pruning(spec: RunSpec) -> RunSpec:
    """``spec`` with the :class:`~nnx_es.search.pruning.TrialPruning` callback last (once)."""
    if any(c.target == _PRUNING.target for c in spec.callbacks):
        return spec
    return msgspec.structs.replace(spec, callbacks=[*spec.callbacks, _PRUNING])


def _monitor(spec: RunSpec, allowed: Allowed) -> Any:
    if spec.monitor is None:
        raise ConfigError("a search optimizes the run's monitor: the spec has none (give it a monitor, e.g. "
                          "{'target': 'nnx_es.monitor:Monitor', 'kwargs': {'name': 'val_loss', 'mode': 'min'}})")
    return from_spec(spec.monitor, allowed=allowed, slot="monitor")


def search(spec: RunSpec | Mapping[str, Any] | str | Path, space: Mapping[str, Any] | str | Path, n_trials: int, *,
           sampler: Any = None, pruner: Any = None, storage: Any = None, study_name: str | None = None,
           runs_root: str | Path = "runs", seed: int = 0, allow: Sequence[str] = (),
           echo: Callable[[str], None] | None = None, progress: bool | None = None) -> SearchResult:
    """Search ``space`` around ``spec`` until the study holds ``n_trials`` trials (see the module docstring).

    Args:
        spec: the base spec (a :class:`~nnx_es.recipes.runspec.RunSpec`, its JSON mapping, or a file);
            it must have a monitor: the study minimizes or maximizes its BEST value (the monitor's mode).
        space: ``{path: distribution}`` or a JSON file of it (:mod:`nnx_es.search.space`).
        n_trials: the study's total of trials (those run before, by this or other workers, included):
            starting a finished search again with a larger ``n_trials`` extends it.
        sampler: an Optuna sampler; default TPE, each trial seeded from ``seed``
            (:class:`~nnx_es.search.sampler.TrialSeeded`: the same seed and spec give the same trials,
            and a killed search started again samples as the uninterrupted one would).
        pruner: an Optuna pruner; default ``MedianPruner()``. Each epoch's monitor value is reported to it.
        storage: an Optuna storage or URL (``"sqlite:///search.db"``); default: a journal file under
            ``RUNS_ROOT/studies/<study>/`` (:mod:`nnx_es.search.study`).
        study_name: default ``search-<hash of spec and space>`` (the same command finds its study again).
        runs_root: where the trials' runs go (``<study>-t<number:03d>``) and the study directory.
        allow: packages besides torch and nnx_es the spec's recipes may import (``--allow``).
        echo: called with one line as each trial starts and ends (``print`` for a console).
        progress: each run's progress display (default: when stderr is a terminal).

    Returns:
        The study's trials with their runs' outcomes (:class:`~nnx_es.search.report.SearchResult`).

    Raises:
        ConfigError: a process group of more than one rank; a spec without a monitor; a bad space or
            ``n_trials``; a study of this name that searches another spec, space or direction; a run
            directory a trial of this study did not start.
        RecipeError / UnsafeRecipeError: the spec, or a path of the space (one that names code, a recipe
            or a marker), refused before the study is opened.
        LeaseHeldError / UnsafePathError / EventLogError: a run written by another process, a link or damage.
    """
    single_process("nnx_es.search.search")
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigError(f"n_trials must be an int >= 1, got {n_trials!r}")
    base, allowed = as_spec(spec), Allowed(allow)
    validate_spec(base, allowed)
    monitor = _monitor(base, allowed)
    dists = parse_space(space)
    for path in dists:
        check_path(base, path, allowed)
    apply_overrides(base, {p: d.example() for p, d in dists.items()}, allowed)  # the values' types, up front
    declared = {"format": 1, "spec_hash": canonical_hash(msgspec.to_builtins(base)), "space": space_json(dists),
                "monitor": monitor.name, "mode": monitor.mode}
    name = study_name if study_name is not None else f"search-{canonical_hash(declared)[:10]}"
    check_name(name, "study_name")
    runs_root = Path(runs_root)
    directory = study_dir(runs_root, name)
    claims = Claims(directory)
    direction = "maximize" if monitor.mode == "max" else "minimize"
    say = echo or (lambda line: None)
    with _quiet_optuna():
        with claims.exclusive():
            study = optuna.create_study(
                storage=storage if storage is not None else default_storage(directory), study_name=name,
                direction=direction, sampler=sampler if sampler is not None else named_sampler("tpe", seed),
                pruner=pruner if pruner is not None else optuna.pruners.MedianPruner(), load_if_exists=True)
            _check_study(study, declared, direction)
        worker = _Worker(study, dists, _with_pruning(base), allowed, runs_root, say, progress, n_trials)
        while (taken := worker.take(claims)) is not None:
            trial, lease, resumed = taken
            try:
                worker.run(trial, resumed)
            finally:
                lease.release()
        return study_result(study, runs_root)


def _check_study(study: Any, declared: dict[str, Any], direction: str) -> None:
    have = study.user_attrs.get(STUDY_ATTR)
    if have is None:
        study.set_user_attr(STUDY_ATTR, declared)
    elif have != declared:
        words = {"spec_hash": "spec", "space": "space", "monitor": "monitor", "mode": "monitor mode"}
        differs = [words.get(k, k) for k in declared if have.get(k) != declared[k]] if isinstance(have, dict) else []
        raise ConfigError(f"study {study.study_name!r} searches another {' and '.join(differs) or 'declaration'} than "
                          "this search: refused; give this search another study name (--study)")
    if study.direction.name.lower() != direction:
        raise ConfigError(f"study {study.study_name!r} is set to {study.direction.name.lower()}, this search would "
                          f"{direction} (its monitor's mode): refused")


class _Worker:
    """One process's share of a study: takes trials (:meth:`take`) and runs them (:meth:`run`)."""

    def __init__(self, study: Any, dists: Mapping[str, Dist], base: RunSpec, allowed: Allowed, runs_root: Path,
                 say: Callable[[str], None], progress: bool | None, n_trials: int) -> None:
        self.study, self.dists, self.base, self.allowed = study, dists, base, allowed
        self.runs_root, self.say, self.progress, self.n_trials = runs_root, say, progress, n_trials

    def take(self, claims: Claims) -> tuple[Any, Lease, bool] | None:
        """The next trial with its lease held, and whether it is a killed one taken over; None: none left."""
        with claims.exclusive():
            trials = self.study.get_trials(deepcopy=False)
            for frozen in trials:
                if frozen.state == TrialState.RUNNING and (lease := claims.take(frozen.number)) is not None:
                    # its worker died (no one holds it): continue it under its own number. Optuna's Trial over a
                    # stored trial (what study.ask builds for a new one) keeps its parameters and reports
                    return optuna.trial.Trial(self.study, frozen._trial_id), lease, True
            if sum(t.state != TrialState.WAITING for t in trials) >= self.n_trials:
                return None
            trial = self.study.ask()
            lease = claims.take(trial.number)
            if lease is None:  # nobody takes a trial without the claim lease, and a new number was never taken
                raise RuntimeError(f"trial {trial.number} of study {self.study.study_name!r} is held by another process "
                                   "just after it was created: is a worker of another nnx_es version running?")
            return trial, lease, False

    def run(self, trial: Any, resumed: bool) -> None:
        """Run ``trial`` (or finish a killed one) and tell the study how it ended."""
        params = {path: suggest(trial, path, dist) for path, dist in self.dists.items()}
        run_id = run_id_of(self.study.study_name, trial.number)
        recorded = trial.user_attrs.get("run_id")
        if recorded is None:
            if (self.runs_root / run_id).exists():
                raise ConfigError(f"run directory {str(self.runs_root / run_id)!r} exists, but trial {trial.number} of "
                                  f"study {self.study.study_name!r} never started it: refused (not resumed or "
                                  "cleared); move it away, or give the search another study name")
            trial.set_user_attr("run_id", run_id)
        elif recorded != run_id:
            raise ConfigError(f"trial {trial.number} records run {recorded!r}, not {run_id!r}: refused")
        shown = label(params)
        head = f"trial {trial.number + 1}/{self.n_trials} (#{trial.number}, run {run_id})"
        self.say(f"{head} {shown}: {'resuming' if resumed else 'starting'}")
        try:
            spec = apply_overrides(self.base, params, self.allowed)
        except NnxError as exc:  # a sampled value the spec refuses: the trial fails, the search goes on
            self._fail(trial, head, f"{type(exc).__name__}: {exc}")
            return
        done = train_trial(spec, runs_root=self.runs_root, run_id=run_id, allowed=self.allowed,
                           prepare=lambda built: _attach(built, trial), progress=self.progress)
        self._tell(trial, head, done.outcome, done.error)

    def _fail(self, trial: Any, head: str, error: str) -> None:
        trial.set_user_attr("error", error[:1000])
        self.study.tell(trial, state=TrialState.FAIL)
        self.say(f"{head}: failed: {error}")

    def _tell(self, trial: Any, head: str, outcome: RunOutcome | None, error: str | None) -> None:
        state = expected_state(outcome)
        if state == TrialState.FAIL or outcome is None:
            self._fail(trial, head, error or (f"the run ended {outcome.status}" if outcome else "no run was made"))
            return
        if state == TrialState.PRUNED:
            self.study.tell(trial, state=TrialState.PRUNED)
            text = f"pruned at epoch {outcome.epochs - 1}"
        else:
            self.study.tell(trial, outcome.best)
            text = f"{outcome.status}, BEST {outcome.monitor} {outcome.best:.6g} (epoch {outcome.best_epoch})"
        try:
            best = self.study.best_trial
            text += f"; best so far {best.value:.6g} (#{best.number})"
        except ValueError:  # no complete trial yet
            pass
        self.say(f"{head}: {text}")


def _attach(built: Any, trial: Any) -> None:
    """Hand ``trial`` to the run's pruning callback."""
    for cb in built.trainer.callbacks:
        if isinstance(cb, TrialPruning):
            cb.attach(trial)

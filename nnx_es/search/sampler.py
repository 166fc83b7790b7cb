"""Samplers whose draws depend on the trial, not on the process: a search killed and started again
samples its later trials as the uninterrupted search did.

An Optuna sampler seeded once (``TPESampler(seed=0)``) draws from one random stream for the whole
process: after a restart the stream starts over, so the trials sampled after it differ from those
of a search that was never stopped. :class:`TrialSeeded` gives each trial (and each of its
independently sampled parameters) a fresh sampler seeded from ``(seed, trial number, parameter)``:
its draws are a function of the seed, the trial's number and the study's finished trials -- the
same after a restart (in a study one worker runs; with several, the trials each sees finished
depend on timing, as in any parallel search). ``sampler(name, seed)`` builds the ones the CLI names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from nnx_es.errors import ConfigError

__all__ = ["SAMPLERS", "TrialSeeded", "sampler"]

#: the samplers ``nnx-es search --sampler`` names, each a factory of a seed
SAMPLERS: dict[str, Callable[[int], BaseSampler]] = {
    "tpe": lambda seed: optuna.samplers.TPESampler(seed=seed),
    "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
}


def _derived(seed: int, number: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{number}/{name}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


class TrialSeeded(BaseSampler):
    """A sampler made afresh for each trial by ``factory(derived_seed)`` (see the module docstring).

    ``sample_relative`` (and the search space it infers) uses the trial's sampler, seeded from
    ``(seed, number)``; ``sample_independent`` one seeded from ``(seed, number, parameter name)``, so a
    parameter's value does not depend on which others were drawn before it in the same process.
    """

    def __init__(self, factory: Callable[[int], BaseSampler], seed: int = 0) -> None:
        self.factory, self.seed = factory, int(seed)
        self._made: dict[tuple[int, str], BaseSampler] = {}

    def _for(self, number: int, name: str = "") -> BaseSampler:
        key = (number, name)
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = self.factory(_derived(self.seed, number, name))
        return made

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self._for(trial.number).infer_relative_search_space(study, trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return self._for(trial.number).sample_relative(study, trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        inner = self._for(trial.number, param_name)
        inner.before_trial(study, trial)
        return inner.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._for(trial.number).before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        self._for(trial.number).after_trial(study, trial, state, values)
        for key in [k for k in self._made if k[0] == trial.number]:
            del self._made[key]

    def reseed_rng(self) -> None:
        """Nothing: the draws are a function of the seed and the trial by design (Optuna calls this in
        forked workers of ``study.optimize(n_jobs=...)``, which a search does not use)."""


def sampler(name: str, seed: int = 0) -> BaseSampler:
    """The sampler ``name`` (:data:`SAMPLERS`), each trial seeded from ``seed`` (:class:`TrialSeeded`).

    Raises:
        ConfigError: an unknown name.
    """
    factory = SAMPLERS.get(name)
    if factory is None:
        raise ConfigError(f"unknown sampler {name!r} (known: {', '.join(SAMPLERS)}; in Python, pass any Optuna "
                          "sampler)")
    return TrialSeeded(factory, seed)

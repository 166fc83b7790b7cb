"""``TrialPruning``: the callback a search adds to each trial's run.

At each epoch's end it reports the epoch's one monitor decision (``ctx.decision.value``, the
value BEST, ReduceLROnPlateau and EarlyStopping see; spec 000 §6.4) to the Optuna trial as
``trial.report(value, epoch)``, then asks ``trial.should_prune()``; on yes it requests the stop
through ``ctx.request_stop("pruned")`` -- the public way a callback stops a run (EarlyStopping's
way): the epoch commits, the run finalizes with status ``stopped``, reason ``pruned``, and audits
clean like any stopped run.

It is part of the trial's recorded spec (``{"target": "nnx_es.search.pruning:TrialPruning"}``, no
keywords), so the run resumes with it; the trial itself is handed to it by the search
(:meth:`attach`). Built from the spec alone (``nnx-es resume`` of a trial's run outside the search)
it has no trial and does nothing. It keeps no state of its own (the trial's reports live in the
study): a resumed run reports its epochs again, and a step reported before is left as it was.
This module does not import Optuna.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from nnx_es.callbacks import Callback

if TYPE_CHECKING:
    from nnx_es.runtime.context import TrainContext

__all__ = ["TrialPruning"]


class TrialPruning(Callback):
    """Report each epoch's monitor value to an Optuna trial; stop the run (reason ``pruned``) when it says so."""

    distributed = "all"  # searches refuse a group of several ranks; declared for completeness

    def __init__(self) -> None:
        self.trial: Any = None

    def attach(self, trial: Any) -> None:
        """Report to ``trial`` (an ``optuna.Trial``) from now on."""
        self.trial = trial

    def on_epoch_end(self, ctx: TrainContext) -> None:
        decision = ctx.decision
        if self.trial is None or decision is None or decision.epoch != ctx.epoch:
            return
        with warnings.catch_warnings():  # a resumed run reports an epoch the killed one reported: kept as it was
            warnings.filterwarnings("ignore", message=".*is already reported.*")
            self.trial.report(decision.value, decision.epoch)
        if self.trial.should_prune():
            ctx.request_stop("pruned", by=self.name)

"""Crash and write-fault tests of your own training code (model, loaders, callbacks, schedulers).

    from nnx_es.testing import Fit, crash_test

    def build(runs_root, run_id):
        net = ...; opt = ...
        trainer = Trainer(net, opt, loss, runs_root=runs_root, run_id=run_id, seed=0, progress=False)
        return Fit(trainer, train_loader, val_loader)

    report = crash_test(build, epochs=3, points=50)
    assert report.ok, report

:func:`crash_test` SIGKILLs a fit at chosen points (event boundaries, persistence steps) and
checks that each run audits clean, keeps the reference's committed state and resumes to the
reference's final state bitwise; :func:`fault_test` fails the persistence steps with an errno
instead. The reports are values (:mod:`nnx_es.testing.report`). The pytest plugin
(:mod:`nnx_es.testing.pytest_plugin`) gives the fixtures ``crash_test`` and ``fault_test``;
``nnx-es crashtest train.py`` does the same for a script that calls ``fit`` itself
(:mod:`nnx_es.testing.script`); ``NNX_ES_KILL_AT`` kills any training process at a point
(:mod:`nnx_es.injection`). POSIX only (``os.fork``).

:func:`power_loss_test` goes further than a kill (which keeps the page cache): it traces one fit's
writes and syncs below Python and checks the states a power cut after each sync may leave
(:mod:`nnx_es.testing.powerloss`; ``nnx-es crashtest --power-loss train.py`` for a script).
"""

from nnx_es.testing.harness import Build, Fit, Points, crash_test, fault_test
from nnx_es.testing.powerloss import power_loss_test
from nnx_es.testing.report import CrashReport, Failure, FaultReport, HarnessFailure, PowerLossReport, Report

__all__ = [
    "Build",
    "CrashReport",
    "Failure",
    "FaultReport",
    "Fit",
    "HarnessFailure",
    "Points",
    "PowerLossReport",
    "Report",
    "crash_test",
    "fault_test",
    "power_loss_test",
]

"""``nnx-es search``: a hyper-parameter search on Optuna (:func:`nnx_es.search.search`), or its audit.

    nnx-es search spec.json --space space.json --trials N [--workers K] [--storage URL] [--study NAME]
                  [--runs-dir runs] [--sampler tpe|random] [--seed S] [--pruner median|none]
                  [--pruner-startup N] [--plots DIR | --no-plots] [--allow PKG]
    nnx-es search --audit STUDY [--storage URL] [--runs-dir runs] [--no-replay]

One line per trial as it starts and ends (trial k of N, the BEST, the best so far), then the trials
with their runs' outcomes and two plots (optimization history, parameter importances) in the study's
directory. ``--workers K`` runs K worker processes on the study (this one and K-1 more). The same
command again after a kill or Ctrl-C resumes: a trial whose worker died continues its run from its
LAST under the same trial number. Exit status: 0 done, 2 bad input, 130 interrupted; ``--audit``:
0 every trial agrees with its run, 1 a finding (each on a line).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from nnx_es.cli._common import EXIT_OK, EXIT_VIOLATIONS
from nnx_es.cli.plan import interruptible, say
from nnx_es.cli._specs import BadInput, allowed_packages, guarded, runs_dir

__all__ = ["add_search_command"]


def _worker_argv(args: argparse.Namespace, index: int) -> list[str]:
    """The command line of worker ``index``: this one's, one worker, no report."""
    argv = [sys.executable, "-m", "nnx_es", "search", args.spec, "--space", args.space, "--trials", str(args.trials),
            "--runs-dir", args.runs_dir, "--sampler", args.sampler, "--seed", str(args.seed), "--pruner", args.pruner,
            "--pruner-startup", str(args.pruner_startup), "--worker", str(index)]
    for flag, value in (("--storage", args.storage), ("--study", args.study)):
        if value is not None:
            argv += [flag, value]
    for pkg in args.allow:
        argv += ["--allow", pkg]
    return argv


def _search(args: argparse.Namespace) -> int:
    if args.audit is not None:
        return _audit(args)
    if args.spec is None or args.space is None or args.trials is None:
        raise BadInput("a search needs SPEC, --space SPACE and --trials N (or --audit STUDY)")
    if args.workers < 1:
        raise BadInput(f"--workers takes an int >= 1, got {args.workers}")
    runs_dir(args)  # before a worker starts
    import optuna

    from nnx_es.search import search
    from nnx_es.search.sampler import sampler

    allowed = allowed_packages(args)
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=args.pruner_startup) if args.pruner == "median"
              else optuna.pruners.NopPruner())
    workers: list[subprocess.Popen[bytes]] = []
    if args.workers > 1:
        threads = max(1, (os.cpu_count() or 1) // args.workers)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
        workers = [subprocess.Popen(_worker_argv(args, i), env=env) for i in range(1, args.workers)]
    prefix = f"[worker {args.worker}] " if args.worker or workers else ""
    try:
        result = search(args.spec, args.space, args.trials, sampler=sampler(args.sampler, args.seed), pruner=pruner,
                        storage=args.storage, study_name=args.study, runs_root=args.runs_dir, allow=allowed.user,
                        echo=lambda line: say(prefix + line))
    finally:
        failed = [w.args for w in workers if w.wait() != 0]
    if args.worker:
        return EXIT_OK
    if workers:  # the others may have been running their last trials: read the study again
        result = search(args.spec, args.space, args.trials, sampler=sampler(args.sampler, args.seed), pruner=pruner,
                        storage=args.storage, study_name=args.study, runs_root=args.runs_dir, allow=allowed.user)
    for line in result.table().splitlines():
        say(line)
    if not args.no_plots:
        from nnx_es.search.study import STUDIES_DIR

        where = Path(args.plots) if args.plots else Path(args.runs_dir) / STUDIES_DIR / result.study_name
        try:
            written = result.plots(where)
            say("plots: " + ", ".join(str(p) for p in written))
        except ImportError:
            say("plots: skipped (matplotlib is not installed: pip install 'nnx_es[plots]')")
    if failed:
        say(f"warning: {len(failed)} worker process(es) exited with an error (their output is above)")
    say(f"audit: nnx-es search --audit {result.study_name} --runs-dir {args.runs_dir}"
        + (f" --storage {args.storage}" if args.storage else ""))
    return EXIT_OK


def _audit(args: argparse.Namespace) -> int:
    from nnx_es.search import audit_study

    report = audit_study(args.audit, storage=args.storage, runs_root=args.runs_dir, replay=not args.no_replay)
    for line in report.findings:
        say(line)
    say(f"study {report.study_name}: {report.trials} trials, "
        + ("every trial agrees with its run" if report.ok else f"{len(report.findings)} finding(s)"))
    return EXIT_OK if report.ok else EXIT_VIOLATIONS


def add_search_command(sub: Any) -> None:
    """Add ``search`` to the ``nnx-es`` sub-parsers ``sub``."""
    p = sub.add_parser("search", help="hyper-parameter search on Optuna, each trial an audited run (or --audit)",
                       description="Search SPACE around SPEC until the study holds N trials, each trial a run under "
                       "RUNS_DIR that reports each epoch's monitor value to the study and is pruned by it; the same "
                       "command again resumes (a killed trial continues from its LAST under its own number). "
                       "--audit STUDY checks every trial of a study against its run.")
    p.add_argument("spec", nargs="?", help="the base spec (JSON, as nnx-es init writes); it needs a monitor")
    p.add_argument("--space", help="the space (JSON): {\"optimizers.main.kwargs.lr\": {\"float\": [1e-4, 0.1], "
                   "\"log\": true}, ...}; also int and categorical")
    p.add_argument("--trials", type=int, help="the study's total of trials")
    p.add_argument("--workers", type=int, default=1, help="worker processes sharing the study (default 1)")
    p.add_argument("--storage", default=None, help="an Optuna storage URL (default: a journal file under "
                   "RUNS_DIR/studies/STUDY/)")
    p.add_argument("--study", default=None, help="the study's name (default: from a hash of the spec and space)")
    p.add_argument("--runs-dir", default="runs", help="the runs root (default runs/)")
    p.add_argument("--sampler", default="tpe", choices=("tpe", "random"), help="the sampler (default tpe)")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed (default 0; each trial seeded from it)")
    p.add_argument("--pruner", default="median", choices=("median", "none"), help="the pruner (default median)")
    p.add_argument("--pruner-startup", type=int, default=5,
                   help="the median pruner prunes nothing before this many trials completed (default 5)")
    p.add_argument("--plots", default=None, help="where the plots go (default: the study's directory)")
    p.add_argument("--no-plots", action="store_true", help="write no plots")
    p.add_argument("--audit", metavar="STUDY", default=None,
                   help="check every trial of STUDY against its run (value = the run's BEST, state, parameters, "
                   "reports, the run's own audit); exit 1 on a finding")
    p.add_argument("--no-replay", action="store_true", help="with --audit: skip each run's own audit (tools/replay)")
    p.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)  # a --workers child: no report
    p.add_argument("--allow", action="append", metavar="PKG", default=[],
                   help="also allow recipes to import from package PKG (repeatable)")
    p.set_defaults(run=interruptible("search", guarded("search", _search)))

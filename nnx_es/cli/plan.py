"""``nnx-es plan PLAN.json``: run an experiment plan (:class:`nnx_es.ExperimentPlan`), or report it.

    nnx-es plan plan.json [--runs-dir runs] [--allow PKG] [--report]

``plan.json``: ``{"name": "lr", "spec": "spec.json", "grid": {"optimizers.main.kwargs.lr": [0.001, 0.01]},
"seeds": [0, 1]}`` (or ``"overrides": [{path: value}, ...]`` instead of ``"grid"``; the spec's path is
relative to the plan file, or the spec itself inline). One line per trial as it starts and ends,
then the trials ranked by their runs' BEST. The same command again after a kill or Ctrl-C resumes
the plan. Exit status: 0 every trial completed or stopped, 1 a trial failed or was refused, 2 bad
input (one line on stderr), 130 interrupted (run it again to resume).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nnx_es.cli._common import EXIT_INTERRUPTED, EXIT_OK, EXIT_VIOLATIONS
from nnx_es.cli._format import printable
from nnx_es.cli._specs import allowed_packages, guarded, runs_dir

__all__ = ["add_plan_command", "interruptible", "say"]


def say(line: str) -> None:
    """One progress line on stdout, escaped (it quotes a spec's values), flushed."""
    print(printable(line), flush=True)


def interruptible(command: str, fn: Any) -> Any:
    """``fn(args)``, Ctrl-C said in one line (what was stopped is resumed by the same command), exit 130."""
    def run(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except KeyboardInterrupt:
            print(f"nnx-es {command}: interrupted; the same command resumes it", file=sys.stderr)
            return EXIT_INTERRUPTED
    return run


def _plan(args: argparse.Namespace) -> int:
    from nnx_es.plan import ExperimentPlan

    root = args.runs_dir if args.report else runs_dir(args)  # a report only reads
    allowed = allowed_packages(args)
    plan = ExperimentPlan.load(args.plan, allow=allowed.user)
    report = plan.report(root) if args.report else plan.fit(root, echo=say)
    for line in report.table().splitlines():
        say(line)
    bad = [r for r in report.rows if r.status not in ("completed", "stopped")]
    return EXIT_VIOLATIONS if bad and not args.report else EXIT_OK


def add_plan_command(sub: Any) -> None:
    """Add ``plan`` to the ``nnx-es`` sub-parsers ``sub``."""
    p = sub.add_parser("plan", help="run an experiment plan: a spec with a grid or list of overrides and seeds",
                       description="Run each trial of PLAN (a base spec with a grid or list of overrides and seeds) "
                       "as its own run under RUNS_DIR, recording the plan in RUNS_DIR/plans/NAME; the same command "
                       "again resumes it (ended trials are not rerun, the interrupted one continues from its LAST). "
                       "Prints the trials ranked by their runs' BEST.")
    p.add_argument("plan", help="the plan file (JSON: name, spec, grid or overrides, seeds)")
    p.add_argument("--runs-dir", default="runs", help="the runs root (default runs/)")
    p.add_argument("--report", action="store_true", help="only print the plan's report (run nothing)")
    p.add_argument("--allow", action="append", metavar="PKG", default=[],
                   help="also allow recipes to import from package PKG (repeatable)")
    p.set_defaults(run=interruptible("plan", guarded("plan", _plan)))

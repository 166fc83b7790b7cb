"""``nnx-es <command>``: the project's command, with sub-commands (also ``python -m nnx_es``).

    nnx-es crashtest train.py [--points N|all] [--seed S] [--jobs J] [-- script arguments]
    nnx-es crashtest --power-loss train.py [--states N] [--seed S] [--jobs J] [-- script arguments]
    nnx-es init | report | run | resume ...   (training from a spec: nnx_es.cli.train)
    nnx-es serve RUNS_ROOT [--host 127.0.0.1] [--port 8000]   (the read-only web app: nnx_es.web)
    nnx-es export | predict ...               (a run's model, verified / its predictions: nnx_es.cli.exports)
    nnx-es plan PLAN.json ...                 (an experiment plan: nnx_es.cli.plan)
    nnx-es search SPEC --space S --trials N   (a search on Optuna, or --audit STUDY: nnx_es.cli.search)
    nnx-es diagnose RUN [--plot PATH] [--json]   (a run's training problems: nnx_es.cli.diagnose)

``crashtest`` runs a script that calls ``fit`` itself under crash injection
(:mod:`nnx_es.testing.script`: each point in a process forked from the command's own, 20 points
sampled by default, the count of ``--points all`` printed), or with ``--power-loss`` checks the states a power cut may leave
(:mod:`nnx_es.testing.powerloss`), and prints the report: exit 0 when every point holds,
1 when any fails, 2 when the script's own uninterrupted run fails.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from nnx_es.cli._common import EXIT_OK, EXIT_UNUSABLE, EXIT_VIOLATIONS
from nnx_es.cli.exports import add_commands as add_export_commands
from nnx_es.cli.plan import add_plan_command
from nnx_es.cli.search import add_search_command
from nnx_es.cli.diagnose import add_command as add_diagnose
from nnx_es.cli.train import add_commands
from nnx_es.web.serve import add_command as add_serve

__all__ = ["build_parser", "main"]

#: the points ``crashtest`` samples without ``--points`` (a 3-epoch toy has ~110 in all)
DEFAULT_POINTS = 20


def _points(text: str) -> int | str:
    if text == "all":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--points takes an int >= 1 or 'all', got {text!r}")
    return n


def _states(text: str) -> int:
    n = int(text) if text.isdigit() else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--states takes an int >= 1, got {text!r}")
    return n


def _crashtest(args: argparse.Namespace) -> int:
    from nnx_es.testing.powerloss import powerloss_script
    from nnx_es.testing.script import ScriptError, crashtest_script
    from nnx_es.testing.tracer import NoCompilerError

    argv = [args.script, *args.script_args]
    try:
        if args.power_loss:
            report = powerloss_script(argv, states=args.states, seed=args.seed, jobs=args.jobs)
        else:
            report = crashtest_script(argv, points=args.points, seed=args.seed, jobs=args.jobs)
    except (ScriptError, RuntimeError, NoCompilerError) as exc:
        print(f"nnx-es crashtest: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    print(report)
    if not args.power_loss and len(report.tried) < report.available:
        print(f"(a sample of {len(report.tried)} points, seed {args.seed}; --points all runs all {report.available})")
    return EXIT_OK if report.ok else EXIT_VIOLATIONS


def build_parser() -> argparse.ArgumentParser:
    """The ``nnx-es`` argument parser, sub-commands included (the docs' CLI reference is generated from it)."""
    parser = argparse.ArgumentParser(prog="nnx-es", description="nnx_es commands")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    crash = sub.add_parser(
        "crashtest", help="SIGKILL a training script at sampled points and check each run resumes bitwise",
        description="Run SCRIPT (which calls fit itself) uninterrupted once, then once per point in a process forked from "
        "this one, killed there, and resumed; check each against the uninterrupted run. Exit 0: every point holds; "
        "1: a point fails; 2: the script's uninterrupted run fails.",
    )
    crash.add_argument("script", help="the training script (it trains one run)")
    crash.add_argument("--points", type=_points, default=DEFAULT_POINTS,
                       help=f"N points spread over the run (default {DEFAULT_POINTS}), or 'all' (the report says how "
                       "many that is)")
    crash.add_argument("--seed", type=int, default=0, help="seed of the draw of the points (default 0)")
    crash.add_argument("--jobs", type=int, default=2, help="points checked side by side (default 2)")
    crash.add_argument("--power-loss", action="store_true",
                       help="instead of killing the script, trace its file operations (an LD_PRELOAD shim built with "
                       "the system C compiler) and check the states a power cut after each sync may leave")
    crash.add_argument("--states", type=_states, default=300,
                       help="with --power-loss: the budget of crash states (default 300)")
    crash.set_defaults(run=_crashtest)
    add_commands(sub)
    add_serve(sub)
    add_export_commands(sub)  # export, predict
    add_plan_command(sub)
    add_search_command(sub)
    add_diagnose(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # the script's own arguments follow "--"
    args = build_parser().parse_args(argv[:cut])
    args.script_args = argv[cut + 1:]
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())

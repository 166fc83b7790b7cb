"""What the spec commands share (``nnx-es init | report | run | resume``, ``export``, ``predict``, ``plan``,
``search``): reading a spec file or a stored run's spec, ``--allow``, ``--runs-dir``, and the one-line
error every bad input ends in (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from nnx_es.artifacts import refuse_inside_run
from nnx_es.cli._common import EXIT_OK, EXIT_UNUSABLE, reader_left
from nnx_es.cli._format import printable
from nnx_es.errors import NnxError

__all__ = ["BadInput", "allowed_packages", "guarded", "read_spec_file", "runs_dir", "say", "stored_spec"]


class BadInput(Exception):
    """Exit 2 with this one-line message."""


def say(command: str, exc: BaseException) -> None:
    print(printable(f"nnx-es {command}: {' '.join(str(exc).split())}"), file=sys.stderr)  # a spec's text, escaped


def allowed_packages(args: argparse.Namespace) -> Any:
    """The guard for ``--allow``: the user's own packages (never the standard library: ``--allow os`` would make
    ``os.popen`` a data factory; never torch or nnx_es, see :class:`~nnx_es.recipes.Allowed`).

    Raises BadInput when ``--allow`` names the standard library."""
    from nnx_es.recipes import Allowed

    stdlib = [p for p in args.allow or () if p.split(".")[0] in sys.stdlib_module_names]
    if stdlib:
        raise BadInput(f"--allow {stdlib[0]!r} is the standard library: --allow names your own package (its classes "
                       "are type-checked, its functions become factories)")
    if args.allow:
        _find_packages_beside(getattr(args, "spec", None))
    return Allowed(args.allow or ())


def _find_packages_beside(spec: str | None) -> None:
    """Let ``--allow``'s packages be found as ``python -m nnx_es`` finds them: in the working directory,
    and beside the spec file. The ``nnx-es`` console script's ``sys.path`` starts at its own ``bin/``, so
    without this a package next to the spec was "No module named ...". The directories go at the END of
    ``sys.path``: an installed package (torch) is never shadowed by a file there; the guard still type-checks
    everything imported from them."""
    for d in (Path.cwd(), Path(spec).resolve().parent if spec else None):
        if d is not None and str(d) not in sys.path:
            sys.path.append(str(d))


def read_spec_file(path: str) -> Any:
    """The spec at ``path`` (:func:`nnx_es.recipes.runspec.load_spec`: a regular JSON file of at most 16 MiB).

    Raises RecipeError naming the path when it is missing, not a regular file, too large or not a spec."""
    from nnx_es.recipes.runspec import load_spec

    return load_spec(path)


# --- init ----------------------------------------------------------------------------------


def runs_dir(args: argparse.Namespace) -> str:
    """``--runs-dir``, where a command creates runs: refused when it is or lies inside a run
    (:func:`nnx_es.artifacts.refuse_inside_run`, the check ``export`` makes of ``--out``).

    Raises:
        ConfigError: ``--runs-dir`` lies inside a run.
    """
    refuse_inside_run(args.runs_dir, f"--runs-dir {args.runs_dir!r}")
    return str(args.runs_dir)


def stored_spec(run_dir: Path) -> Any:
    """The spec a run recorded in its ``run_started`` (None when it recorded none), its ``spec_hash``
    verified (:func:`nnx_es.recipes.runspec.spec_of_run`); the caller validates it like a file.

    Raises:
        BadInput: not a run directory, or a log that does not start with ``run_started``.
        RecipeError: the spec does not match its hash, or does not decode.
    """
    from events.log import LmdbLog
    from events.schema import RunStarted
    from nnx_es.recipes.runspec import spec_of_run

    if not (run_dir / "events.lmdb").is_dir():
        raise BadInput(f"{str(run_dir)!r} is not a run directory (no events.lmdb)")
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        first = next(iter(log.read()), None)
    if first is None or not isinstance(first[1], RunStarted):
        raise BadInput(f"{str(run_dir)!r}: its log does not start with run_started")
    return spec_of_run(first[1])


def _where_allowed_is_looked_for(args: argparse.Namespace, exc: BaseException) -> str:
    """For an ``--allow``'d module that does not import: where :func:`_find_packages_beside` looked, and what to do
    (a resume without ``--spec`` has no spec file: the working directory alone)."""
    missing = [p for p in getattr(args, "allow", None) or ()
               if f"No module named '{p.split('.')[0]}'" in str(exc)]
    if not missing:
        return ""
    spec = getattr(args, "spec", None)
    where = list(dict.fromkeys([str(Path.cwd())] + ([str(Path(spec).resolve().parent)] if spec else [])))
    return (f"; --allow {missing[0]!r} is looked for in the working directory" + (" and beside the spec file" if spec
            else "") + f" ({', '.join(where)}): run from the directory holding it, or put it on PYTHONPATH or install it")


def guarded(command: str, fn: Any) -> Any:
    """``fn(args)`` as a sub-command's ``run``: bad input (:class:`BadInput`, an ``NnxError``, an ``OSError``)
    is said in one line on stderr, exit 2; stdout's reader leaving (``nnx-es report spec.json | head -1``) ends
    it quietly, exit 0, as ``nnx-inspect`` does (:func:`nnx_es.cli._common.reader_left`)."""
    def run(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except BrokenPipeError:
            reader_left()
            return EXIT_OK
        except (BadInput, NnxError, OSError) as exc:
            say(command, BadInput(f"{exc}{_where_allowed_is_looked_for(args, exc)}"))
            return EXIT_UNUSABLE
    return run

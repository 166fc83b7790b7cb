"""``nnx-es diagnose RUN [--plot PATH] [--json]``: a run's training problems, each with its evidence.

Reads the run's committed view only (:func:`nnx_es.diagnose`): never writes into the
run, which may be someone else's (``--plot`` inside it is refused). Exit status: 0 no findings,
1 findings, 2 unusable input (not a run, an unreadable log, a link under the run, a bad ``--plot``
path); with ``--json`` such an error is also printed on stdout as ``{"error": {"type", "message"}}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from nnx_es.cli._common import EXIT_OK, EXIT_VIOLATIONS, fail, reader_left
from nnx_es.cli._format import json_line, printable
from nnx_es.errors import NnxError

__all__ = ["add_command"]


def _diagnose(args: argparse.Namespace) -> int:
    from nnx_es.diagnostics.findings import diagnose
    from nnx_es.diagnostics.plot import check_plot_path, plot_diagnosis

    try:
        if args.plot is not None:
            check_plot_path(args.plot, args.run_dir)  # before anything is read
        diagnosis = diagnose(args.run_dir)
        if args.plot is not None:
            plot_diagnosis(diagnosis, args.plot)
    except (NnxError, OSError) as exc:  # not a run, a damaged or forged log, a link under it, a bad --plot path
        return fail("nnx-es diagnose", str(exc), error_type=type(exc).__name__, as_json=args.json)
    except ImportError as exc:
        return fail("nnx-es diagnose", f"--plot needs matplotlib ({exc}): pip install 'nnx_es[plots]'",
                    error_type="ImportError", as_json=args.json)
    try:
        if args.json:
            out: dict[str, Any] = diagnosis.to_json()
            if args.plot is not None:
                out["plot"] = str(args.plot)
            sys.stdout.write(json_line(out) + "\n")
        else:
            print(diagnosis)
            if args.plot is not None:
                print(printable(f"plot: {args.plot}"))
        sys.stdout.flush()
    except BrokenPipeError:
        reader_left()
    return EXIT_VIOLATIONS if diagnosis.findings else EXIT_OK


def add_command(sub: Any) -> None:
    """Add ``diagnose`` to the ``nnx-es`` sub-parsers ``sub``."""
    p = sub.add_parser(
        "diagnose", help="find a run's training problems (exploding/vanishing gradients, dead units, ...)",
        description="Read RUN's committed events and report exploding or vanishing gradients, dead units, an "
        "update/weight ratio far from ~1e-3, a widening train/validation gap, skipped non-finite updates and a "
        "plateau, each with its evidence and threshold (per-layer checks need the run to have been trained with "
        "nnx_es.Diagnostics(every=N)). Exit 0: no findings, 1: findings, 2: unusable input.",
    )
    p.add_argument("run_dir", type=Path, metavar="RUN", help="the run directory, runs/<id>")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH",
                   help="also write a PNG of the curves there (outside the run)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    p.set_defaults(run=_diagnose)
